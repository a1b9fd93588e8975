"""The P/D proxy's edge over real HTTP: the instances' validation up front (every class of bad
body refused with the instances' status and body while other clients' requests finish,
through a real proxy process in front of a real `kvferry serve`), SSE parsed by its framing
(U+2028, U+2029 and U+0085 inside an event), odd upstream statuses, OpenAI-shaped 404/405,
/metrics behind the key, pooled connections the instance closed, and read timeouts."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvferry.entrypoints.proxy.app import build_app
from kvferry.entrypoints.proxy.config import ProxyConfig
from tests import plain_http
from tests.edge_inputs import (
    STARTUP_S,
    bad_beside_good,
    bad_inputs,
    check_bad_head_refused,
    check_log_has_no_crash,
    counted_statuses,
    disconnect_lines,
    integer_body,
    leave_mid_body,
    post_while_polling_health,
)
from tests.proxy_fakes import FakeInstance, free_port, serve_in_thread, start_cli, stop, wait_healthy

# slow: a `kvferry serve` process and a proxy process (make test-all only)
pytestmark = pytest.mark.slow

SEPARATORS = ["Hello", " line\u2028sep", " para\u2029sep", " next\x85line", " end"]


@pytest.fixture(scope="module")
def proxy_and_log(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A proxy process (logging at INFO, to the path given) in front of one colocated
    `kvferry serve` playing both roles."""
    logs = tmp_path_factory.mktemp("proxy_edge")
    server, proxy = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    args = ["--log-level", "WARNING", "serve", str(tiny_llama), "--port", server.rsplit(":", 1)[1]]
    procs = [start_cli(args + ["--kv-cache-memory", "0.01", "--enforce-eager"], logs / "server.log")]
    proxy_args = ["--log-level", "INFO", "proxy", "--prefill", server, "--decode", server]
    procs.append(start_cli(proxy_args + ["--port", proxy.rsplit(":", 1)[1]], logs / "proxy.log"))
    try:
        wait_healthy(procs[0], server, logs / "server.log", STARTUP_S)
        wait_healthy(procs[1], proxy, logs / "proxy.log")
        yield proxy, logs / "proxy.log"
    finally:
        codes = stop(procs)
    assert codes == [0, 0], codes


@pytest.fixture(scope="module")
def proxy_url(proxy_and_log: tuple[str, Path]) -> str:
    return proxy_and_log[0]


def test_bad_inputs_are_refused_up_front_and_others_finish(proxy_url: str, tiny_llama: Path) -> None:
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    asyncio.run(bad_beside_good(proxy_url, {}, bad_inputs(vocab)))
    assert plain_http.get(proxy_url + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("count", [4_000_000, 20_000])
def test_a_costly_integer_body_does_not_stall_health(proxy_url: str, count: int) -> None:
    """4 million token ids in 8 MB (under the body limit; over the JSON value limit) and
    20,000 (under both: decoded in a worker thread, the last id refused): /health keeps
    answering meanwhile. Decoding 4 million ids on the event loop would stall it for
    seconds; the 0.5 s bound leaves room for one slow probe on a busy 2-vCPU host (a full
    suite run saw one of 187 ms)."""
    resp, took, health = post_while_polling_health(proxy_url, integer_body(count))
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error", resp.text
    assert took < 30, took  # generous: the bound that matters is the next one
    assert health and max(health) < 0.5, (took, health)


def test_a_client_leaving_mid_body_is_one_line_and_a_499(proxy_and_log: tuple[str, Path]) -> None:
    url, log = proxy_and_log
    leave_mid_body(url)
    lines = disconnect_lines(log)
    assert len(lines) == 1 and "/v1/completions" in lines[0], lines
    check_log_has_no_crash(log)
    statuses = counted_statuses(plain_http.get(url + "/metrics").text, "/v1/completions")
    assert statuses.get("499") == 1 and "500" not in statuses, statuses


def test_bad_request_heads_are_400(proxy_url: str) -> None:
    check_bad_head_refused(proxy_url)
    assert plain_http.get(proxy_url + "/health").status_code == 200


@contextmanager
def _proxy(prefill: list[str], decode: list[str], **kw) -> Iterator[str]:
    kw.setdefault("health_interval_s", 60.0)
    with serve_in_thread(build_app(ProxyConfig(tuple(prefill), tuple(decode), **kw))) as url:
        yield url


def _separator_decoder() -> FastAPI:
    """A decode instance whose streamed text holds the characters str.splitlines breaks on."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    async def events() -> AsyncIterator[str]:
        for i, piece in enumerate(SEPARATORS):
            choice = {
                "index": 0,
                "text": piece,
                "logprobs": None,
                "finish_reason": "length" if i == 4 else None,
            }
            yield f"data: {json.dumps({'id': 'x', 'choices': [choice]}, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        await request.body()
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_stream_with_line_separators_arrives_whole() -> None:
    prefill = FakeInstance("prefill0")
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(app)) for app in (prefill.app, _separator_decoder())]
        proxy = stack.enter_context(_proxy([urls[0]], [urls[1]]))
        client = openai.OpenAI(base_url=proxy + "/v1", api_key="x", max_retries=0)
        stream = client.completions.create(model="m", prompt="hi", max_tokens=8, stream=True)
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        # Also read as raw SSE: events end with a blank line; no line breaks inside one.
        with plain_http.stream(
            "POST", proxy + "/v1/completions", json={"prompt": "hi", "stream": True}
        ) as resp:
            raw = resp.read().decode()
    assert text == "".join(SEPARATORS)
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]".removeprefix("data: ")
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "".join(SEPARATORS)
    assert len([line for line in raw.splitlines() if line]) == len(events)  # one line each, even so


@pytest.mark.parametrize(("upstream", "client"), [(400, 400), (404, 404), (500, 502), (418, 502), (302, 502)])
def test_odd_upstream_statuses_are_not_passed_through(upstream: int, client: int) -> None:
    prefill, decode = FakeInstance("prefill0"), FakeInstance("decode0")
    decode.fail_status = upstream
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(f.app)) for f in (prefill, decode)]
        proxy = stack.enter_context(_proxy([urls[0]], [urls[1]]))
        resp = plain_http.post(proxy + "/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert resp.status_code == client
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if client == 502:
        assert error["type"] == "bad_gateway" and f"HTTP {upstream}" in error["message"]


def test_unknown_routes_and_methods_are_openai_shaped_and_metrics_need_the_key() -> None:
    prefill, decode = FakeInstance("prefill0"), FakeInstance("decode0")
    auth = {"Authorization": "Bearer sk-p"}
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(f.app)) for f in (prefill, decode)]
        proxy = stack.enter_context(_proxy([urls[0]], [urls[1]], api_key="sk-p"))
        public = stack.enter_context(_proxy([urls[0]], [urls[1]], api_key="sk-p", metrics_public=True))
        for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/completions", 405)):
            resp = plain_http.request(method, proxy + path, headers=auth)
            assert resp.status_code == status and set(resp.json()["error"]) == {
                "message",
                "type",
                "param",
                "code",
            }
        for path in ("/metrics", "/openapi.json"):
            assert plain_http.get(proxy + path).status_code == 401, path
            assert plain_http.get(proxy + path, headers=auth).status_code == 200, path
            assert plain_http.get(public + path).status_code == 200, path
        assert plain_http.get(proxy + "/health").status_code == 200


class ClosingServer:
    """A raw HTTP/1.1 server that answers the first request of each connection (keep-alive)
    and closes the connection when a second one arrives on it, unanswered: what a pooled
    connection looks like when the instance's keep-alive timer fires as the request is sent."""

    ANSWER = {"id": "x", "object": "text_completion", "model": "m",
              "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}  # fmt: skip

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.closed_unanswered = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            for answered in (False, True):
                if not self._read_request(conn):
                    return
                if answered:
                    self.closed_unanswered += 1
                    return
                body = json.dumps(self.ANSWER).encode()
                head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
                conn.sendall(head.encode() + body)

    @staticmethod
    def _read_request(conn: socket.socket) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return False
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next(
            (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
        )
        while len(rest) < length:
            rest += conn.recv(65536)
        return True


def test_a_pooled_connection_the_instance_closed_is_retried() -> None:
    upstream = ClosingServer()
    with _proxy([upstream.url], [upstream.url], early_first_token=False) as proxy:
        for _ in range(5):  # each leg after the first finds its pooled connection closed
            resp = plain_http.post(proxy + "/v1/completions", json={"prompt": "hi"}, timeout=10)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == "ok"
            resp = plain_http.get(proxy + "/v1/models", timeout=10)
            assert resp.status_code == 200, resp.text
    assert upstream.closed_unanswered >= 5
    upstream.sock.close()


def test_a_silent_decoder_times_out_and_the_prefill_is_released() -> None:
    prefill, decode = FakeInstance("prefill0"), FakeInstance("decode0")
    decode.delay = 3.0  # far beyond the read timeout
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(f.app)) for f in (prefill, decode)]
        proxy = stack.enter_context(_proxy([urls[0]], [urls[1]], read_timeout_s=0.5))
        start = time.monotonic()
        resp = plain_http.post(proxy + "/v1/completions", json={"prompt": "hi"}, timeout=20)
        took = time.monotonic() - start
        deadline = time.monotonic() + 5
        while not prefill.released and time.monotonic() < deadline:
            time.sleep(0.05)
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "gateway_timeout"
    assert took < 10
    assert prefill.released == ["prefill0-0"]


class SlowPrefill(FakeInstance):
    """A prefill instance that takes ``delay`` for "slow" prompts and refuses "bad" ones at once."""

    async def _answer(self, body: dict, chat: bool):
        if body.get("prompt") == "bad":
            self.requests.append(body)
            return JSONResponse({"error": {"message": "bad", "type": "invalid_request_error"}}, 400)
        return await super()._answer(body, chat)


def _wait_released(prefill: FakeInstance, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not prefill.released and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True])
def test_a_leg_cancelled_while_its_prefill_answers_releases_the_kv(stream: bool) -> None:
    """The client leaves while the prefill is running: its answer, arriving later, is released."""
    prefill, decode = SlowPrefill("prefill0"), FakeInstance("decode0")
    prefill.delay = 1.0
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(f.app)) for f in (prefill, decode)]
        proxy = stack.enter_context(_proxy([urls[0]], [urls[1]]))
        with pytest.raises(httpx.ReadTimeout):
            plain_http.post(proxy + "/v1/completions", json={"prompt": "slow", "stream": stream}, timeout=0.3)
        _wait_released(prefill)
    assert prefill.released == ["prefill0-0"] and not decode.requests


def test_a_batch_whose_other_prompt_is_refused_releases_the_kv() -> None:
    prefill, decode = SlowPrefill("prefill0"), FakeInstance("decode0")
    prefill.delay = 1.0
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(f.app)) for f in (prefill, decode)]
        proxy = stack.enter_context(_proxy([urls[0]], [urls[1]]))
        resp = plain_http.post(proxy + "/v1/completions", json={"prompt": ["slow", "bad"]}, timeout=10)
        assert resp.status_code == 400
        _wait_released(prefill)
    # the fake names the kept KV after its request count when it answers: both had arrived
    assert prefill.released == ["prefill0-1"] and not decode.requests


def _hanging_decoder() -> FastAPI:
    """A decode instance that streams one chunk, then says nothing more."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    async def events() -> AsyncIterator[str]:
        choice = {"index": 0, "text": "Hello", "logprobs": None, "finish_reason": None}
        yield f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"
        await asyncio.sleep(3)  # far beyond the read timeout

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        await request.body()
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_a_decoder_silent_mid_stream_ends_the_stream_with_a_timeout_error() -> None:
    prefill = FakeInstance("prefill0")
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(app)) for app in (prefill.app, _hanging_decoder())]
        proxy = stack.enter_context(_proxy([urls[0]], [urls[1]], read_timeout_s=0.5))
        start = time.monotonic()
        body = {"prompt": "hi", "stream": True}
        with plain_http.stream("POST", proxy + "/v1/completions", json=body, timeout=20) as resp:
            events = [line for line in resp.iter_lines() if line]
        took = time.monotonic() - start
    assert resp.status_code == 200 and events[-1] == "data: [DONE]" and took < 10
    assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "gateway_timeout"
