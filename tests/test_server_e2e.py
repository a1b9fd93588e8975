"""End to end: `kvferry serve` in its own process on a tiny real model, driven over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvferry.engine.llm import LLM
from kvferry.ports import free_port
from kvferry.sampling_params import SamplingParams
from tests import plain_http

MODEL = "tiny"
KEY = "sk-e2e"
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [f"The {w} sees a small bird" for w in ("cat", "dog", "king", "robot")] + [
    f"Count from {i} to ten." for i in range(12)
]


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return float(value)
    raise KeyError(name)


@pytest.fixture(scope="module")
def server_proc(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """The server process, started (not yet healthy: the reference runs meanwhile)."""
    port = free_port()
    log = tmp_path_factory.mktemp("e2e") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "kvferry.entrypoints.cli",
        "--log-level",
        "WARNING",
        "serve",
        str(tiny_llama),
    ]
    cmd += ["--served-model-name", MODEL, "--port", str(port), "--api-key", KEY, "--kv-cache-memory", "0.005"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def url(server_proc: tuple, reference: dict[str, str]) -> str:
    proc, base, log = server_proc
    _wait_healthy(proc, base, log)
    return base


def _wait_healthy(proc: subprocess.Popen, base: str, log: Path) -> None:
    deadline = time.monotonic() + 180  # model load and compile on a loaded 2-core host
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if plain_http.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail("server not healthy after 180 s")


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, server_proc: tuple) -> dict[str, str]:
    """Greedy completions of PROMPTS from the offline engine, in this process."""
    llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20, enforce_eager=True)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def _http(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)


def _wait_idle(url: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = plain_http.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        total = _metric(text, "kvferry:num_blocks")
        if (
            _metric(text, "kvferry:num_requests_running") == 0
            and _metric(text, "kvferry:num_requests_waiting") == 0
            and _metric(text, "kvferry:num_free_blocks") == total
            and _metric(text, "kvferry:kv_cache_usage_perc") == 0
        ):
            return text
        assert time.monotonic() < deadline, "KV blocks not freed"
        time.sleep(0.05)


def test_completions_match_offline_engine(url: str, reference: dict[str, str]) -> None:
    client = _client(url)
    prompt = PROMPTS[0]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert resp.choices[0].text == reference[prompt]
    assert resp.usage.completion_tokens == 12 and resp.choices[0].finish_reason == "length"
    chunks = list(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == reference[prompt]


def test_n_min_tokens_and_prompt_logprobs(url: str, reference: dict[str, str]) -> None:
    prompt = PROMPTS[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "n": 2, "min_tokens": 12}
    auth = {"Authorization": f"Bearer {KEY}"}
    resp = plain_http.post(url + "/v1/completions", json={**body, "prompt_logprobs": 1}, headers=auth).json()
    assert [(c["index"], c["text"]) for c in resp["choices"]] == [
        (0, reference[prompt]),
        (1, reference[prompt]),
    ]
    prompt_logprobs = resp["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == resp["usage"]["prompt_tokens"]
    assert all(
        1 <= len(entry) <= 2 and all(v["rank"] >= 1 for v in entry.values()) for entry in prompt_logprobs[1:]
    )
    assert resp["usage"]["completion_tokens"] == 24
    bad = plain_http.post(url + "/v1/completions", json={**body, "logit_bias": {"1": 200}}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_prompt_logprobs_streamed_and_in_chat(url: str) -> None:
    """Streamed, a choice's first chunk carries its prompt_logprobs (vLLM's place); chat
    returns them at the top of the response (streamed: of the first chunk)."""
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0, "prompt_logprobs": 2}
    with _http(url) as http:
        whole = http.post("/v1/completions", json={**body, "n": 2}).json()
        want = whole["choices"][0]["prompt_logprobs"]
        assert len(want) == whole["usage"]["prompt_tokens"] and want[0] is None
        chunks = _sse(http.post("/v1/completions", json={**body, "n": 2, "stream": True}).text)
        sent = [(c["choices"][0]["index"], c["choices"][0].get("prompt_logprobs")) for c in chunks]
        assert sorted(index for index, plp in sent if plp is not None) == [0, 1]  # once per choice
        firsts = {index: plp for index, plp in reversed(sent)}  # each choice's first chunk
        assert firsts == {0: want, 1: want}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        chat_whole = http.post("/v1/chat/completions", json={**chat, "prompt_logprobs": 1}).json()
        chat_want = chat_whole["prompt_logprobs"]
        assert len(chat_want) == chat_whole["usage"]["prompt_tokens"]
        chat_chunks = _sse(
            http.post("/v1/chat/completions", json={**chat, "prompt_logprobs": 1, "stream": True}).text
        )
        assert chat_chunks[0]["prompt_logprobs"] == chat_want
        assert all("prompt_logprobs" not in c for c in chat_chunks[1:])
    _wait_idle(url)


def test_chat_stream_and_not(url: str) -> None:
    client = _client(url)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert resp.choices[0].message.role == "assistant" and resp.usage.completion_tokens <= 10
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == resp.choices[0].message.content
    )
    assert chunks[-1].usage.total_tokens == resp.usage.total_tokens


def test_16_concurrent_streams(url: str, reference: dict[str, str]) -> None:
    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def go() -> list[str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    assert len(PROMPTS) == 16
    assert asyncio.run(go()) == [reference[p] for p in PROMPTS]
    _wait_idle(url)


def test_prefix_cache_hits_show_in_usage(url: str) -> None:
    client = _client(url)
    prompt = " ".join(["the old man reads a golden book by the sea"] * 6)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert (
        _metric(
            plain_http.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text,
            "kvferry:prefix_cache_hits_total",
        )
        >= 16
    )


def test_aborted_stream_frees_blocks(url: str) -> None:
    _wait_idle(url)
    with _http(url) as http:
        body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 500, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            busy = http.get("/metrics").text
            assert _metric(busy, "kvferry:num_requests_running") == 1
            assert _metric(busy, "kvferry:kv_cache_usage_perc") > 0
    idle = _wait_idle(url)
    assert _metric(idle, "kvferry:request_success_total", finished_reason="abort") >= 1


def test_aborted_non_stream_frees_blocks(url: str) -> None:
    with _http(url) as http:
        body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 500, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=0.3)
    _wait_idle(url)


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", {"prompt": [10] * 1100}, 400),  # longer than the context
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.01}, 400),
        ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400),
        ("/v1/completions", {"prompt": {"a": 1}}, 400),
        ("/v1/completions", {"prompt": "hi", "model": "nope"}, 404),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400),
        ("/v1/chat/completions", {"messages": 3}, 400),
    ],
)
def test_bad_input(url: str, path: str, body: dict, status: int) -> None:
    with _http(url) as http:
        resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_malformed_json_and_api_key(url: str) -> None:
    with _http(url) as http:
        resp = http.post("/v1/completions", content=b"{nope", headers={"Content-Type": "application/json"})
    assert resp.status_code == 400
    assert plain_http.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).completions.create(
            model=MODEL, prompt="x"
        )


def test_still_serving_after_everything(url: str, reference: dict[str, str]) -> None:
    resp = _client(url).completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=12, temperature=0)
    assert resp.choices[0].text == reference[PROMPTS[3]]
    _wait_idle(url)
