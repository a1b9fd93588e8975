"""Units of the HTTP edge: strict JSON parsing, request models' refusals, SSE framing."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from fastapi import FastAPI, Request

from kvferry.entrypoints.edge import check_content_type, parse_json, parse_model, read_json
from kvferry.entrypoints.edge_options import EdgeLimits
from kvferry.entrypoints.http_common import CLIENT_CLOSED_STATUS, sse
from kvferry.entrypoints.openai.errors import install_error_handlers
from kvferry.entrypoints.openai.protocol import CompletionRequest
from kvferry.entrypoints.proxy.sse import SSEDecoder
from kvferry.errors import InvalidRequestError
from kvferry.sampling_params import SamplingParams


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
