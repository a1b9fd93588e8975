"""Units of the HTTP edge: strict JSON parsing, request models' refusals, SSE framing."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from kvferry.entrypoints.edge import (
    BodyDecoder,
    check_content_type,
    check_prompt_lengths,
    check_value_count,
    parse_json,
    parse_model,
    read_json,
)
from kvferry.entrypoints.edge_http import head_problem
from kvferry.entrypoints.edge_options import EdgeLimits
from kvferry.entrypoints.http_common import CLIENT_CLOSED_STATUS, sse
from kvferry.entrypoints.openai.errors import install_error_handlers
from kvferry.entrypoints.openai.protocol import CompletionRequest
from kvferry.entrypoints.proxy.sse import SSEDecoder
from kvferry.errors import InvalidRequestError
from kvferry.sampling_params import SamplingParams
from kvferry.scheduler.request import resolve_max_tokens


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": NaN}',
        b'{"a": -Infinity}',
        b'{"a": 9223372036854775808}',
        b'{"a": -9223372036854775809}',
        b'{"a": ' + b"1" * 5000 + b"}",
        b'{"a": "\\ud800"}',
        b'{"\\udc00": 1}',
        b"[" * 33 + b"]" * 33,
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a": "\xff"}',
        b"{nope",
    ],
)
def test_parse_json_refuses(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_json(raw)
    assert info.value.status_code == 400


def test_parse_json_takes_the_edges() -> None:
    raw = b'{"a": [9223372036854775807, -9223372036854775808, 1.5e300, "\\ud83d\\ude00"]}'
    assert parse_json(raw) == {"a": [2**63 - 1, -(2**63), 1.5e300, "\U0001f600"]}
    assert parse_json(b"[" * 32 + b"]" * 32)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [1, 2.0]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": "x", "stream": "true"}, "stream"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "seed": 2**63}, "seed"),
        ({"prompt": "x", "top_k": -(2**63) - 1}, "top_k"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_request_models_are_strict_and_int64(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_model(CompletionRequest, body)
    assert info.value.param.split(".")[0] == param


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_only_json_content_types(content_type: str) -> None:
    with pytest.raises(InvalidRequestError):
        check_content_type(content_type)
    check_content_type("application/json; charset=utf-8")
    check_content_type(None)


def test_sse_framing_keeps_unicode_separators_and_handles_split_line_ends() -> None:
    decoder = SSEDecoder()
    stream = 'data: {"t": "a\u2028b\u2029c\x85d\x0be"}\r\n\r\n: keep-alive\n\ndata: x\rdata: y\r\n\r\ndata: [DONE]\n\n'
    events = []
    for i in range(0, len(stream), 3):  # every split point, CR LF across pieces included
        events += decoder.feed(stream[i : i + 3])
    assert events == ['{"t": "a\u2028b\u2029c\x85d\x0be"}', "x\ny", "[DONE]"]


@pytest.mark.parametrize(
    "kw",
    [
        {"seed": 2**64},
        {"top_k": 2**63},
        {"max_tokens": True},
        {"stop_token_ids": [2**70]},
        {"temperature": float("inf")},
        {"temperature": 1e308},  # inf in float32
        {"top_p": 1e-300},  # 0 in float32: the nucleus would keep nothing
        {"repetition_penalty": 1e-300},  # 0 in float32: a division by zero
        {"presence_penalty": float("nan")},
    ],
)
def test_sampling_params_refuse_what_a_batch_tensor_cannot_hold(kw: dict) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_sse_events_are_one_line_even_for_splitlines() -> None:
    obj = {"text": 'a\u2028b\u2029c\x85d\x0be"f\\'}
    event = sse(obj)
    assert event.endswith("\n\n") and event.splitlines() == [event[:-2], ""]
    assert json.loads(event.removeprefix("data: ")) == obj


def test_a_client_gone_while_its_body_is_read_is_not_an_internal_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Part of the body, then a disconnect (a proxy dropping an aborted client's upstream
    call, seen in the soak): answered 499 quietly, not logged as an error nor re-raised."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        return {"body": await read_json(request, EdgeLimits())}

    incoming = [
        {"type": "http.request", "body": b'{"prompt": "hi', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
    }  # fmt: skip
    with caplog.at_level(logging.INFO):
        asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == CLIENT_CLOSED_STATUS
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_value_count_is_an_upper_bound_checked_before_parsing() -> None:
    body = b'{"a": [1, 2, 3], "b": {"c": "d"}}'  # 10 values (keys too): {} [] 1 2 3 "a" "b" {} "c" "d"
    check_value_count(body, 10)
    with pytest.raises(InvalidRequestError, match="more than 9 JSON values"):
        check_value_count(body, 9)
    with pytest.raises(InvalidRequestError):
        check_value_count(b"[" + b"1," * 300_000 + b"1]", 2**18)  # counted across slices


def test_prompts_longer_than_the_context_are_refused_by_length() -> None:
    ok = {"prompt": [1] * 9, "prompt_token_ids": [1] * 9}
    assert check_prompt_lengths(ok, 10) is ok
    assert check_prompt_lengths({"prompt": ["a"] * 100}, 10)  # a batch of texts: the model's
    for body in ({"prompt": [1] * 10}, {"prompt": [[1], [1] * 10]}, {"prompt_token_ids": [1] * 10}):
        with pytest.raises(InvalidRequestError, match="maximum context length is 10") as info:
            check_prompt_lengths(body, 10)
        assert info.value.param == "prompt"


def test_one_bad_id_after_many_is_found_fast_and_named() -> None:
    """pydantic stops at a list's first bad item (it once reported every one, for each
    member of the prompt union: 15 s for 262,144 ids)."""
    with pytest.raises(InvalidRequestError) as info:
        parse_model(CompletionRequest, {"prompt": [1] * 200_000 + [-1]})
    assert info.value.param == "prompt"
    errors = info.value.__cause__.errors()  # type: ignore[union-attr]
    assert len(errors) <= 4, len(errors)  # one per union member, not one per item


def test_large_bodies_are_decoded_off_the_event_loop() -> None:
    app = FastAPI()
    install_error_handlers(app)
    decoder = BodyDecoder()
    threads: list[str] = []

    def check(value: object) -> object:
        threads.append(threading.current_thread().name)
        return value

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        return {"body": await decoder.read(request, check)}

    small, large = {"prompt": "hi"}, {"prompt": "x" * 20_000}
    with TestClient(app) as client:
        assert client.post("/v1/completions", json=small).json() == {"body": small}
        assert client.post("/v1/completions", json=large).json() == {"body": large}
    assert not threads[0].startswith("kvferry-body"), threads  # small: decoded on the loop
    assert threads[1].startswith("kvferry-body"), threads
    decoder.close()


@pytest.mark.parametrize(
    ("head", "problem"),
    [
        (b"POST / HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\r\n b\r\n\r\n", "folding"),
        (b"POST / HTTP/1.1\nHost: x\nX-Request-Id: a\n\tb\n\n", "folding"),
        (b"POST / HTTP/1.1\r\nX-Request-Id: a\x01b\r\n\r\n", "control"),
        (b"POST / HTTP/1.1\r\nX-Request-Id: a\rb\r\n\r\n", "control"),
        (b"POST / HTTP/1.1\r\nX-Request-Id: a\x7f\r\n\r\n", "control"),
        (b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\nContent-Length: 3\r\n\r\n", "Transfer"),
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n", "Transfer"),
    ],
)
def test_request_heads_refused(head: bytes, problem: str) -> None:
    assert problem in (head_problem(head) or "")


def test_request_heads_accepted() -> None:
    head = b"POST / HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\tb\r\nContent-Length: 3\r\n\r\n"
    assert head_problem(head) is None
    assert head_problem(head + b"\r\n x\x01") is None  # the body is not the head
    assert head_problem(b"POST / HTTP/1.1\r\nX-A: b\r\n\tc") is None  # partial line: not yet


def test_default_max_tokens_caps_only_requests_that_set_none() -> None:
    assert resolve_max_tokens(None, 10, 100) == 90  # to the end of the context, as vLLM
    assert resolve_max_tokens(None, 10, 100, default_max_tokens=5) == 5
    assert resolve_max_tokens(20, 10, 100, default_max_tokens=5) == 20
    assert resolve_max_tokens(None, 98, 100, default_max_tokens=5) == 2
