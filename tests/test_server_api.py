"""The OpenAI server over the fake core: real HTTP (uvicorn in a thread), real tokenizer."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from kvferry.config import CacheConfig, EngineConfig
from kvferry.engine.async_engine import AsyncEngine
from kvferry.engine.core_fake import (
    CRASH_TOKEN,
    FAIL_ADD_TOKEN,
    FAIL_STEP_TOKEN,
    FakeCoreFactory,
    fake_model_config,
)
from kvferry.entrypoints.openai.server import build_app
from kvferry.ports import free_port
from tests import plain_http

MODEL = "fake-model"
KEY = "sk-test"
NUM_BLOCKS = 256
MAX_MODEL_LEN = 256


@dataclass
class Server:
    url: str
    engine: AsyncEngine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10, **kw)


def serve_in_thread(
    engine: AsyncEngine, api_key: str | None = KEY
) -> tuple[uvicorn.Server, threading.Thread, str]:
    port = free_port()
    app = build_app(engine, MODEL, api_key=api_key)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}"


def make_engine(model_dir: Path, step_delay_s: float = 0.002) -> AsyncEngine:
    model = fake_model_config(local_dir=str(model_dir), max_model_len=MAX_MODEL_LEN)
    config = EngineConfig(model=model, cache=CacheConfig(block_size=4))
    return AsyncEngine.from_config(config, FakeCoreFactory(step_delay_s=step_delay_s, num_blocks=NUM_BLOCKS))


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[Server]:
    engine = make_engine(tiny_llama)
    uv, thread, url = serve_in_thread(engine)
    yield Server(url, engine)
    uv.should_exit = True
    thread.join(10)
    engine.shutdown()


def expected_ids(first: int, n: int) -> list[int]:
    return [(first + 7 * (i + 1)) % 1000 for i in range(n)]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return float(value)
    raise KeyError(name)


def wait_idle(server: Server, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    with server.http() as http:
        while True:
            text = http.get("/metrics").text
            idle = metric(text, "kvferry:num_requests_running") == 0
            full = metric(text, "kvferry:num_free_blocks") == NUM_BLOCKS
            if idle and full and metric(text, "kvferry:kv_cache_usage_perc") == 0:
                return text
            assert time.monotonic() < deadline, "engine did not return to idle"
            time.sleep(0.02)


# -- happy paths -------------------------------------------------------------------------


def test_completion(server: Server) -> None:
    resp = server.client().completions.create(model=MODEL, prompt=[100, 101], max_tokens=5, temperature=0)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert resp.choices[0].text == server.engine.tokenizer.decode(expected_ids(100, 5))
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (2, 5, 7)
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_stream_matches(server: Server) -> None:
    client = server.client()
    full = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=8).choices[0].text
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Hello there",
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_completion_batch(server: Server) -> None:
    client = server.client()
    resp = client.completions.create(model=MODEL, prompt=["one", "two three"], max_tokens=3)
    assert [c.index for c in resp.choices] == [0, 1] and resp.usage.completion_tokens == 6
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(
        model=MODEL, prompt=["one", "two three"], max_tokens=3, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {0: resp.choices[0].text, 1: resp.choices[1].text}


def test_n_answers_per_prompt_streamed_with_their_index(server: Server) -> None:
    client = server.client()
    resp = client.completions.create(model=MODEL, prompt=[[140], [150]], max_tokens=3, temperature=0, n=3)
    tok = server.engine.tokenizer
    assert [c.index for c in resp.choices] == list(range(6))
    assert [c.text for c in resp.choices] == [tok.decode(expected_ids(140, 3))] * 3 + [
        tok.decode(expected_ids(150, 3))
    ] * 3
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (2, 18)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content != ""
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        n=2,
        stream=True,
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}
    with server.http() as http:
        body = {"prompt": "hi", "n": 2, "best_of": 3, "stream": True}
        assert http.post("/v1/completions", json=body).json()["error"]["param"] == "best_of"
    wait_idle(server)


def test_token_batch_and_single_token_stream(server: Server) -> None:
    client = server.client()
    resp = client.completions.create(model=MODEL, prompt=[[110, 111], [120]], max_tokens=2)
    tok = server.engine.tokenizer
    assert [c.text for c in resp.choices] == [
        tok.decode(expected_ids(110, 2)),
        tok.decode(expected_ids(120, 2)),
    ]
    assert resp.usage.prompt_tokens == 3
    chunks = list(client.completions.create(model=MODEL, prompt=[130], max_tokens=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == tok.decode(expected_ids(130, 1))
    assert chunks[-1].choices[0].finish_reason == "length"
    wait_idle(server)


def test_chat(server: Server) -> None:
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6)
    assert resp.object == "chat.completion" and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == resp.choices[0].message.content
    )
    assert (
        chunks[-2].choices[0].finish_reason == "length"
        and chunks[-1].usage.total_tokens == resp.usage.total_tokens
    )


def test_chat_content_parts_and_model_default(server: Server) -> None:
    with server.http() as http:
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}], "max_tokens": 2}
        resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200 and resp.json()["model"] == MODEL


def test_logprobs(server: Server) -> None:
    client = server.client()
    comp = client.completions.create(model=MODEL, prompt=[200], max_tokens=3, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert (
        len(content) == 3 and len(content[0].top_logprobs) == 2 and content[0].logprob == pytest.approx(-0.1)
    )


def test_stop_string(server: Server) -> None:
    full = server.engine.tokenizer.decode(expected_ids(300, 12))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    resp = server.client().completions.create(model=MODEL, prompt=[300], max_tokens=12, stop=stop)
    assert resp.choices[0].text == full[: full.index(stop)] and resp.choices[0].finish_reason == "stop"
    wait_idle(server)


def test_kv_transfer_params_returned(server: Server) -> None:
    with server.http() as http:
        body = {
            "model": MODEL,
            "prompt": [400],
            "max_tokens": 2,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        resp = http.post("/v1/completions", json=body).json()
        assert resp["kv_transfer_params"] == {"echo": {"do_remote_decode": True}, "num_tokens": 3}
        body = {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "kv_transfer_params": {"a": 1},
        }
        assert http.post("/v1/chat/completions", json=body).json()["kv_transfer_params"]["echo"] == {"a": 1}


def test_models_health(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert plain_http.get(server.url + "/health").status_code == 200  # no key needed


def test_concurrent_streams(server: Server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=[500 + i], max_tokens=10 + i, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def go() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    texts = asyncio.run(go())
    tok = server.engine.tokenizer
    assert texts == [tok.decode(expected_ids(500 + i, 10 + i)) for i in range(16)]
    wait_idle(server)


# -- disconnects free blocks --------------------------------------------------------------


def test_stream_disconnect_frees_blocks(server: Server) -> None:
    before = metric(wait_idle(server), "kvferry:request_success_total", finished_reason="abort")
    with server.http() as http:
        body = {"model": MODEL, "prompt": [600], "max_tokens": 200, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            text = http.get("/metrics").text
            assert metric(text, "kvferry:num_requests_running") == 1
            assert metric(text, "kvferry:num_free_blocks") < NUM_BLOCKS
    after = wait_idle(server)  # the closed connection aborted the request in the core
    assert metric(after, "kvferry:request_success_total", finished_reason="abort") == before + 1


def test_non_stream_disconnect_frees_blocks(server: Server) -> None:
    wait_idle(server)
    with server.http() as http:
        body = {"model": MODEL, "prompt": [610], "max_tokens": 200}
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=0.15)
    wait_idle(server)


# -- bad input ----------------------------------------------------------------------------


BAD_COMPLETIONS = [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "hi", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"x5": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5000": 1}}, "logit_bias"),
    ({"prompt": "hi", "allowed_token_ids": [5000]}, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "hi", "bad_words": [""]}, "bad_words"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": list(range(10, 10 + MAX_MODEL_LEN))}, "prompt"),
    ({"prompt": [10] * 200, "max_tokens": 100}, "max_tokens"),
    ({"prompt": [5000]}, "prompt"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "hi", "echo": True}, "echo"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_is_400(server: Server, body: dict, param: str, stream: bool) -> None:
    with server.http() as http:
        resp = http.post("/v1/completions", json={"model": MODEL, "stream": stream, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x" * 2000}]}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS)
def test_bad_chat_is_400(server: Server, body: dict, param: str) -> None:
    with server.http() as http:
        resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_malformed_json_is_400(server: Server) -> None:
    with server.http() as http:
        resp = http.post(
            "/v1/completions", content=b'{"prompt": "hi", ', headers={"Content-Type": "application/json"}
        )
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]


def test_unknown_model_is_404(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        server.client().completions.create(model="gpt-17", prompt="hi")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])


def test_openai_client_raises_bad_request(server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().completions.create(model=MODEL, prompt="hi", temperature=-1)


def test_api_key(server: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        resp = plain_http.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert plain_http.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    for path in ("/metrics", "/openapi.json"):  # the key guards them too
        resp = plain_http.get(server.url + path)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", path
        assert (
            plain_http.get(server.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        )


def test_bad_requests_leave_server_serving(server: Server) -> None:
    wait_idle(server)
    assert server.client().completions.create(model=MODEL, prompt=[700], max_tokens=2).choices[0].text


# -- engine errors ------------------------------------------------------------------------


def test_engine_error_fails_one_request(server: Server) -> None:
    with server.http() as http:
        for stream in (False, True):  # the failure is known before the first token: a plain 500
            body = {"prompt": [FAIL_ADD_TOKEN, 10], "max_tokens": 2, "stream": stream}
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
    assert server.client().completions.create(model=MODEL, prompt=[701], max_tokens=2).choices[0].text
    text = wait_idle(server)
    assert metric(text, "kvferry:request_success_total", finished_reason="error") >= 2


def test_engine_error_mid_stream_is_an_sse_error_event(server: Server) -> None:
    with server.http() as http:
        body = {"prompt": [720], "max_tokens": 200, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            # a step failure fails everything in flight, the open stream included
            failed = http.post("/v1/completions", json={"prompt": [FAIL_STEP_TOKEN, 10], "max_tokens": 2})
            events = [line for line in lines if line]
    assert failed.status_code == 500
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    assert "step failure" in json.loads(events[-2][len("data: ") :])["error"]["message"]
    wait_idle(server)


def test_metrics_content(server: Server) -> None:
    server.client().completions.create(model=MODEL, prompt=[800, 801, 802], max_tokens=4)
    text = wait_idle(server)
    assert metric(text, "kvferry:time_to_first_token_seconds_count") >= 1
    assert metric(text, "kvferry:inter_token_latency_seconds_count") >= 3
    assert metric(text, "kvferry:prompt_tokens_total") >= 3
    assert metric(text, "kvferry:generation_tokens_total") >= 4
    assert metric(text, "kvferry:request_success_total", finished_reason="length") >= 1
    assert metric(text, "kvferry:num_blocks") == NUM_BLOCKS
    assert metric(text, "kvferry:prefix_cache_queries_total") >= 3
    assert metric(text, "kvferry:prefix_cache_hits_total", model_name=MODEL) >= 0


def test_dead_engine_is_503(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    uv, thread, url = serve_in_thread(engine, api_key=None)
    try:
        resp = plain_http.post(url + "/v1/completions", json={"prompt": [CRASH_TOKEN, 10]}, timeout=10)
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable_error"
        assert plain_http.get(url + "/health").status_code == 503
        assert plain_http.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 503
        assert metric(plain_http.get(url + "/metrics").text, "kvferry:engine_alive") == 0
    finally:
        uv.should_exit = True
        thread.join(10)
        engine.shutdown()
