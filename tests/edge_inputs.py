"""Test helpers (no tests): hostile request bodies, one per class of bad input, and a load of
good requests to run beside them; raw-socket requests (bad heads, a client leaving mid-body);
/health polled while a costly body is decoded. Shared by the instance and proxy edge tests."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests import plain_http

JSON = {"content-type": "application/json"}
STARTUP_S = 240.0  # a `kvferry serve` on a host shared by several test runs took over 90 s


@dataclass(frozen=True)
class Bad:
    """A body the edge must refuse with ``status`` and an OpenAI error body."""

    name: str
    path: str
    raw: bytes
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    status: int = 400


def _c(text: str) -> bytes:
    return ('{"prompt": "hi", "max_tokens": 4, ' + text + "}").encode()


def bad_inputs(vocab_size: int) -> list[Bad]:
    c, chat = "/v1/completions", "/v1/chat/completions"
    deep = '{"prompt": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    nested = '{"prompt": "hi", "kv_transfer_params": {"a": ' + "[" * 100 + "]" * 100 + "}}"
    msg = '{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 4}'
    return [
        Bad("seed 2**64", c, _c('"seed": 18446744073709551616, "temperature": 0.9')),
        Bad("seed 2**63", c, _c('"seed": 9223372036854775808, "temperature": 0.9')),
        Bad("top_k 2**63", c, _c('"top_k": 9223372036854775808')),
        Bad("huge integer", c, _c('"seed": ' + "9" * 5000)),
        Bad("logprobs 10**29", c, _c('"logprobs": 100000000000000000000000000000')),
        Bad("max_tokens 2**64", c, b'{"prompt": "hi", "max_tokens": 18446744073709551616}'),
        Bad("token id = vocab", c, b'{"prompt": [1, %d], "max_tokens": 4}' % vocab_size),
        Bad("token id 2**63", c, b'{"prompt": [1, 9223372036854775808], "max_tokens": 4}'),
        Bad("float token id", c, b'{"prompt": [1, 2.0], "max_tokens": 4}'),
        Bad("bool token id", c, b'{"prompt": [1, true], "max_tokens": 4}'),
        Bad("negative stop token", c, _c('"stop_token_ids": [-1]')),
        Bad("lone surrogate", c, b'{"prompt": "a\\ud800b", "max_tokens": 4}'),
        Bad("lone surrogate chat", chat, msg.encode()),
        Bad("NaN", c, _c('"temperature": NaN')),
        Bad("Infinity", c, _c('"top_p": Infinity')),
        Bad("-Infinity", c, _c('"presence_penalty": -Infinity')),
        Bad("deep nesting", c, deep.encode()),
        Bad("nesting 100", c, nested.encode()),
        Bad("stream string", c, _c('"stream": "yes"')),
        Bad("stream int", chat, b'{"messages": [{"role": "user", "content": "hi"}], "stream": 1}'),
        Bad("max_tokens bool", c, b'{"prompt": "hi", "max_tokens": true}'),
        Bad("text/plain", c, _c('"seed": 1'), {"content-type": "text/plain"}),
        Bad("form", c, b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}),
        Bad("not UTF-8", c, b'{"prompt": "\xff\xfe", "max_tokens": 4}'),
        Bad("not an object", c, b"[1, 2, 3]"),
    ]


# Bodies at the edges of what is valid: the engine must take them (no step fails).
EXTREME_BUT_VALID = [
    {"prompt": "hi", "max_tokens": 4, "seed": 2**63 - 1, "temperature": 0.9},
    {"prompt": "hi", "max_tokens": 4, "seed": -(2**63), "temperature": 0.9},
    {"prompt": "hi", "max_tokens": 4, "top_k": 2**63 - 1, "temperature": 0.9},
    {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [2**63 - 1]},
]


def check_refusal(resp: httpx.Response, bad: Bad) -> None:
    assert resp.status_code == bad.status, (bad.name, resp.status_code, resp.text[:300])
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], (bad.name, error)
    assert error["type"] == "invalid_request_error", (bad.name, error)


async def good_stream(client: httpx.AsyncClient, i: int) -> str:
    body = {"prompt": f"The cat {i} sees a small bird", "max_tokens": 24, "stream": True, "temperature": 0}
    body["ignore_eos"] = True
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += event["choices"][0]["text"]
    return text


async def good_json(client: httpx.AsyncClient, i: int) -> str:
    body = {"messages": [{"role": "user", "content": f"Count to {i}"}], "max_tokens": 24, "ignore_eos": True}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


async def hammer(client: httpx.AsyncClient, bads: list[Bad], rounds: int) -> list[httpx.Response]:
    """Every bad body ``rounds`` times, and the extreme valid ones; the responses in order."""
    out = []
    for _ in range(rounds):
        for bad in bads:
            out.append(await client.post(bad.path, content=bad.raw, headers=bad.headers))
        for body in EXTREME_BUT_VALID:
            resp = await client.post("/v1/completions", json=body)
            assert resp.status_code == 200, (body, resp.text)
        await asyncio.sleep(0)
    return out


async def bad_beside_good(base_url: str, headers: dict[str, str], bads: list[Bad], rounds: int = 2) -> None:
    """Good streams and answers run while the bad bodies arrive: every good one completes
    (a full answer, no error event) and every bad one is refused."""
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as client:
        goods = [good_stream(client, i) for i in range(4)] + [good_json(client, i) for i in range(3)]
        results = await asyncio.gather(hammer(client, bads, rounds), *goods)
    responses = results[0]
    for i, resp in enumerate(responses):
        check_refusal(resp, bads[i % len(bads)])
    assert all(results[1:])


# Request heads h11 alone would take (obs-fold joined with a space, the chunks framing a body
# that also has a Content-Length, a control character passed on): each must be a 400.
_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
_BODY = b'{"prompt": "hi", "max_tokens": 2}'
_SIZED = b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BODY), _BODY)
BAD_HEADS = {
    "LF inside x-request-id": _HEAD + b"X-Request-Id: abc\n def\r\n" + _SIZED,
    "obs-fold": _HEAD + b"X-Request-Id: abc\r\n\tdef\r\n" + _SIZED,
    "control character": _HEAD + b"X-Request-Id: abc\x01def\r\n" + _SIZED,
    "CL and TE": _HEAD
    + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    + b"%x\r\n%s\r\n0\r\n\r\n" % (len(_BODY), _BODY),
}


def _address(base_url: str) -> tuple[str, int]:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def raw_exchange(base_url: str, request: bytes, timeout: float = 10.0) -> bytes:
    """``request`` sent as bytes; everything the server sends back until it closes."""
    with socket.create_connection(_address(base_url), timeout=timeout) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def check_bad_head_refused(base_url: str) -> None:
    for name, request in BAD_HEADS.items():
        answer = raw_exchange(base_url, request)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), (name, answer[:300])
        assert json.loads(body)["error"]["type"] == "invalid_request_error", (name, body)


LEFT_MID_BODY = "the client left after"  # the one line logged for it


def leave_mid_body(base_url: str) -> None:
    """Headers promising 1,000 bytes of body, 14 of them, then the connection closes."""
    with socket.create_connection(_address(base_url), timeout=10) as conn:
        conn.sendall(_HEAD + b'Content-Length: 1000\r\n\r\n{"prompt": "hi')
        time.sleep(0.2)


def disconnect_lines(log: Path, timeout: float = 15.0) -> list[str]:
    """The log's lines about a client leaving mid-body, once there is one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [line for line in log.read_text().splitlines() if LEFT_MID_BODY in line]
        if lines:
            return lines
        time.sleep(0.1)
    return []


def check_log_has_no_crash(log: Path) -> None:
    text = log.read_text()
    for crash in ("Traceback", "Exception in ASGI application", "internal proxy error", '" 500 '):
        assert crash not in text, (crash, text[-3000:])


def integer_body(count: int) -> bytes:
    """A completion whose prompt is ``count`` token ids, 2 bytes each (costly to decode), the
    last one negative (refused by the request model, after all the others)."""
    return b'{"prompt": [' + b"1," * (count - 1) + b'-1], "max_tokens": 2}'


@dataclass
class Polls:
    """/health answers: (sent, answered) monotonic times."""

    times: list[tuple[float, float]] = field(default_factory=list)

    def during(self, start: float, end: float) -> list[float]:
        """How long each /health took that was under way while [start, end] ran."""
        return [done - sent for sent, done in self.times if sent <= end and done >= start]


def post_while_polling_health(base_url: str, body: bytes) -> tuple[httpx.Response, float, list[float]]:
    """POST ``body`` while /health is asked every 10 ms on a kept-alive connection: the
    answer, how long it took, and how long each /health took meanwhile."""
    polls, done = Polls(), threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=base_url, timeout=60) as http:
            while not done.is_set():
                sent = time.monotonic()
                assert http.get("/health").status_code == 200
                polls.times.append((sent, time.monotonic()))
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.3)  # the poller's connection is open and warm
    try:
        start = time.monotonic()
        resp = plain_http.post(base_url + "/v1/completions", content=body, headers=JSON, timeout=120)
        end = time.monotonic()
    finally:
        done.set()
        poller.join()
    return resp, end - start, polls.during(start, end)


def counted_statuses(metrics_text: str, endpoint: str) -> dict[str, float]:
    """The proxy's requests counter for ``endpoint``, by status."""
    labels = 'endpoint="' + re.escape(endpoint) + r'",status="(\d+)"'
    pattern = r"kvferry_proxy:requests_total\{" + labels + r"\} ([0-9.e+]+)"
    return {status: float(value) for status, value in re.findall(pattern, metrics_text)}
