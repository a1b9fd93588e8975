"""Test helpers (no tests): free ports, uvicorn apps in threads, and fake OpenAI instances.

A fake instance answers like a kvferry server would: a prefill request (max_tokens=1)
gets ``FIRST`` and ``kv_transfer_params`` (``remote_request_id``: ``<name>-<n>``); any
other request gets ``ANSWER`` (streamed in ``ANSWER_CHUNKS`` when asked). It records
every body it receives, and the ids ``POST /v1/kv_transfer/release`` names.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvferry.ports import free_port
from tests import forked_cli, plain_http
from tests.forked_cli import Command, ForkedCommand

logger = logging.getLogger(__name__)

FIRST = "Hello"
ANSWER_CHUNKS = ["Hello", " big", " world"]
ANSWER = "".join(ANSWER_CHUNKS)
ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` on a free port in a background thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _error(status: int, message: str) -> JSONResponse:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": "max_tokens", "code": None}
    }
    return JSONResponse(body, status_code=status)


class FakeInstance:
    """A fake kvferry server; ``health``, ``fail_status`` and ``delay`` change its behaviour."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[dict] = []
        self.released: list[str] = []
        self.health = 200
        self.fail_status: int | None = None
        self.delay = 0.0
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return JSONResponse({"status": "ok" if self.health == 200 else "down"}, status_code=self.health)

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": self.name}]}

        @app.post("/v1/kv_transfer/release")
        async def release(request: Request) -> dict:
            body = await request.json()
            self.released.append(body["request_id"])
            return {"request_id": body["request_id"], "released": True}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._answer(await request.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._answer(await request.json(), chat=True)

        return app

    async def _answer(self, body: dict, chat: bool) -> Response:
        self.requests.append(body)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail_status is not None:
            return _error(self.fail_status, f"{self.name} refuses")
        if body.get("max_tokens") == 1 and body.get("kv_transfer_params", {}).get("do_remote_decode"):
            answer = _full(FIRST, chat, usage=1)
            answer["kv_transfer_params"] = {
                "engine_id": self.name,
                "first_token_id": 7,
                "remote_request_id": f"{self.name}-{len(self.requests) - 1}",
            }
            return JSONResponse(answer)
        if body.get("stream"):
            return StreamingResponse(_stream(chat, body), media_type="text/event-stream")
        return JSONResponse(_full(ANSWER, chat, usage=len(ANSWER_CHUNKS)))


def _full(text: str, chat: bool, usage: int) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
    counts = {"prompt_tokens": 3, "completion_tokens": usage, "total_tokens": 3 + usage}
    return {"id": "x", "object": "chat.completion" if chat else "text_completion", "model": "fake",
            "created": 1, "choices": [choice], "usage": counts}  # fmt: skip


async def _stream(chat: bool, body: dict):
    meta = {"id": "up", "created": 1, "model": "fake"}
    if chat:
        yield _sse({**meta, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    for i, piece in enumerate(ANSWER_CHUNKS):
        reason = "length" if i == len(ANSWER_CHUNKS) - 1 else None
        choice = {"index": 0, "finish_reason": reason}
        choice.update({"delta": {"content": piece}} if chat else {"text": piece, "logprobs": None})
        yield _sse({**meta, "choices": [choice]})
        await asyncio.sleep(0.01)
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        yield _sse({**meta, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# ---- real processes --------------------------------------------------------------------


def start_cli(args: list[str], log: Path) -> ForkedCommand:
    """``kvferry ARGS`` in its own process group, output to ``log`` (tests/forked_cli)."""
    return forked_cli.start(args, log, dict(os.environ, PYTHONPATH=str(ROOT)), ROOT)


def wait_healthy(proc: Command, url: str, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if plain_http.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


def stop(procs: list[Command], timeout: float = 20.0) -> list[int]:
    """SIGINT all, wait, then SIGKILL what is left of their process groups; the exit codes."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return [proc.wait() for proc in procs]
