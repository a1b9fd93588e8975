"""The proxy in front of a real `kvferry serve` process on the tiny llama, no connector, as
both the prefill and the decode instance (colocated: the decoder recomputes the prompt and
ignores the prefill's kv_transfer_params): answers equal the server's own."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests import plain_http
from tests.proxy_fakes import free_port, start_cli, stop, wait_healthy

# slow: a `kvferry serve` process and a proxy process (make test-all only)
pytestmark = pytest.mark.slow

MODEL = "tiny"
KEY = "sk-pd"
PROMPTS = ["The cat sees a small bird", "Count from 3 to ten."]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def urls(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """{"prefill", "decode", "proxy"}: one colocated server plays both roles; all healthy."""
    logs = tmp_path_factory.mktemp("proxy_e2e")
    server_port, proxy_port = free_port(), free_port()
    server = f"http://127.0.0.1:{server_port}"
    args = ["--log-level", "WARNING", "serve", str(tiny_llama), "--served-model-name", MODEL]
    args += ["--port", str(server_port), "--api-key", KEY, "--kv-cache-memory", "0.005", "--enforce-eager"]
    procs = {"server": start_cli(args, logs / "server.log")}
    proxy_args = ["--log-level", "WARNING", "proxy", "--prefill", server, "--decode", server]
    proxy_args += ["--port", str(proxy_port), "--api-key", KEY, "--health-interval", "0.5"]
    procs["proxy"] = start_cli(proxy_args, logs / "proxy.log")
    urls = {"prefill": server, "decode": server, "proxy": f"http://127.0.0.1:{proxy_port}"}
    try:
        wait_healthy(procs["server"], server, logs / "server.log")
        wait_healthy(procs["proxy"], urls["proxy"], logs / "proxy.log")
        yield urls
    finally:
        codes = stop([procs["proxy"], procs["server"]])
    assert codes == [0, 0], codes


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def _completion(url: str, prompt, stream: bool) -> tuple[str, str | None]:
    client = _client(url)
    if not stream:
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        return resp.choices[0].text, resp.choices[0].finish_reason
    chunks = list(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
    )
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_the_direct_server(urls: dict[str, str], stream: bool) -> None:
    for prompt in PROMPTS:
        assert _completion(urls["proxy"], prompt, stream) == _completion(urls["decode"], prompt, stream)


def test_chat_equals_the_direct_server(urls: dict[str, str]) -> None:
    answers = {}
    for name in ("decode", "proxy"):
        client = _client(urls[name])
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == resp.choices[0].message.content
        usage = chunks[-1].usage
        answers[name] = (text, resp.usage.completion_tokens, usage.completion_tokens, usage.prompt_tokens)
    assert answers["proxy"] == answers["decode"]


def test_batch_and_concurrent_streams_equal_the_direct_server(urls: dict[str, str]) -> None:
    def batch(url: str) -> list[str]:
        resp = _client(url).completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
        return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]

    assert batch(urls["proxy"]) == batch(urls["decode"])

    async def streams(url: str) -> list[str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as client:

            async def one(prompt: str) -> str:
                s = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
                )
                return "".join([c.choices[0].text async for c in s])

            return await asyncio.gather(*(one(p) for p in PROMPTS))

    assert asyncio.run(streams(urls["proxy"])) == asyncio.run(streams(urls["decode"]))


def test_upstream_errors_pass_through(urls: dict[str, str]) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    for body in (
        {"model": MODEL, "prompt": "hi", "temperature": -1},
        {"model": "nope", "prompt": "hi"},
        {"model": MODEL, "prompt": [10] * 1100},
    ):
        direct = plain_http.post(urls["decode"] + "/v1/completions", json=body, headers=headers)
        proxied = plain_http.post(urls["proxy"] + "/v1/completions", json=body, headers=headers)
        assert direct.status_code in (400, 404)
        assert (proxied.status_code, proxied.json()) == (direct.status_code, direct.json())
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=urls["proxy"] + "/v1", api_key="wrong", max_retries=0).models.list()


def _metric(url: str, name: str, **labels: str) -> float:
    for line in plain_http.get(
        url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}
    ).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return float(value)
    return 0.0


def test_client_disconnect_aborts_the_decoder(urls: dict[str, str]) -> None:
    aborted = _metric(urls["decode"], "kvferry:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
        with http.stream("POST", urls["proxy"] + "/v1/completions", json={**body, "temperature": 0}) as resp:
            lines = (line for line in resp.iter_lines() if line)
            assert next(lines).startswith("data: ")  # the prefill's token
            assert next(lines).startswith("data: ")  # the decoder's first chunk
            assert _metric(urls["decode"], "kvferry:num_requests_running") == 1
    _wait_not_running(urls["decode"])
    assert _metric(urls["decode"], "kvferry:request_success_total", finished_reason="abort") == aborted + 1
    # a non-streamed client leaves once the decode leg runs (its prefill leg has finished)
    asyncio.run(_leave_while_decoding(urls, {**body, "stream": False, "max_tokens": 1000}))
    _wait_not_running(urls["decode"])
    assert _metric(urls["decode"], "kvferry:request_success_total", finished_reason="abort") == aborted + 2
    health = plain_http.get(urls["proxy"] + "/health").json()
    assert [i["in_flight"] for role in ("prefill", "decode") for i in health["instances"][role]] == [0, 0]


async def _leave_while_decoding(urls: dict[str, str], body: dict) -> None:
    """POST through the proxy; drop the connection once the server finished the prefill leg
    and runs the decode leg (the same server plays both), long before that leg can end."""
    server = urls["decode"]
    prefills = _metric(server, "kvferry:request_success_total", finished_reason="length")
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
        post = asyncio.create_task(http.post(urls["proxy"] + "/v1/completions", json=body))
        deadline = time.monotonic() + 10
        while not (
            _metric(server, "kvferry:request_success_total", finished_reason="length") == prefills + 1
            and _metric(server, "kvferry:num_requests_running") == 1
        ):
            assert not post.done(), "the request ended before the client could leave it"
            assert time.monotonic() < deadline, "the decode leg did not start"
            await asyncio.sleep(0.01)
        post.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await post


def _wait_not_running(url: str) -> None:
    deadline = time.monotonic() + 10
    while _metric(url, "kvferry:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the decoder's request was not aborted"
        time.sleep(0.05)


def test_models_and_metrics(urls: dict[str, str]) -> None:
    models = _client(urls["proxy"]).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (
        _metric(urls["proxy"], "kvferry_proxy:requests_total", endpoint="/v1/completions", status="200") > 0
    )
    assert _metric(urls["proxy"], "kvferry_proxy:instance_healthy", role="decode") == 1
