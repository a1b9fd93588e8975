"""HTTP pieces the OpenAI server and the P/D proxy share: error bodies, API key (and where
it comes from), SSE, disconnects, and awaiting several upstream streams at once.

Kept free of engine imports so the proxy starts without torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from kvferry.errors import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")
K = TypeVar("K")
SSE_DONE = "data: [DONE]\n\n"


def error_body(
    message: str, err_type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


# Line breaks to str.splitlines (so to many clients' SSE line readers, httpx's included)
# that JSON leaves raw: escaped, the event stays one line for them too (same JSON value).
_SPLITLINES_ESCAPES = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as compact JSON, on one line for any reader."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).translate(_SPLITLINES_ESCAPES)
    return f"data: {text}\n\n"


def chat_role_chunk(meta: dict[str, Any]) -> dict[str, Any]:
    """The first chunk of a chat completion stream: the assistant's role, no content yet."""
    role = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return {**meta, "choices": [role]}


API_KEY_ENV = "KVFERRY_API_KEY"


def read_api_key_file(path: str) -> str:
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the API key file {path}: {exc}") from exc
    if not key:
        raise ConfigError(f"the API key file {path} is empty")
    return key


def resolve_api_key(flag: str | None, key_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The API key from --api-key-file, else --api-key, else $KVFERRY_API_KEY; None: no key.

    --api-key shows in every process list of the host: it still works, with a warning.
    """
    if flag is not None and key_file is not None:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        return read_api_key_file(key_file)
    if flag is not None:
        if not flag.strip():
            raise ConfigError("--api-key is empty")
        logger.warning(
            "--api-key is visible to every user of this host (ps, /proc/<pid>/cmdline): "
            "prefer $%s or --api-key-file",
            API_KEY_ENV,
        )
        return flag.strip()
    return environ.get(API_KEY_ENV, "").strip() or None


class ApiKeyMiddleware:
    """Pure ASGI middleware: paths under ``protected`` (default /v1/*) need ``Authorization:
    Bearer <api_key>``, else HTTP 401.

    It runs before routing and body parsing, so a bad key never reaches a handler.
    """

    def __init__(self, app: ASGIApp, api_key: str, protected: tuple[str, ...] = ("/v1",)):
        self.app = app
        self._key = api_key.encode()
        self._protected = protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self._protected):
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self._key):
            await self.app(scope, receive, send)
            return
        message = "Incorrect API key provided." if header else "Missing API key (Authorization: Bearer ...)."
        response = JSONResponse(error_body(message, "invalid_request_error", code="invalid_api_key"), 401)
        await response(scope, receive, send)


CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request": nobody reads it


class ClientDisconnected(Exception):
    """The HTTP client went away before its (non-streaming) answer was ready, or while its
    body was read: answered 499 and counted so, never a 500."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it (and whatever it started upstream) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        logger.info("client disconnected; request cancelled")
        raise ClientDisconnected()
    return task.result()


async def gather_or_cancel(work: Sequence[Awaitable[T]]) -> list[T]:
    """Await all; on the first failure cancel the rest and raise that failure."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def interleave(sources: Sequence[tuple[K, AsyncIterator[T]]]) -> AsyncGenerator[tuple[K, T], None]:
    """Items of several streams as they come, as (key, item); the first failure is raised.

    Each stream is read by its own task (a single one is read directly); the tasks are
    cancelled when this generator is closed. The streams themselves are the caller's to close.
    """
    if len(sources) == 1:
        key, stream = sources[0]
        async for item in stream:
            yield key, item
        return
    queue: asyncio.Queue[tuple[K, T | Exception | None]] = asyncio.Queue()

    async def pump(key: K, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((key, item))
        except Exception as exc:
            await queue.put((key, exc))
        await queue.put((key, None))

    tasks = [asyncio.ensure_future(pump(key, stream)) for key, stream in sources]
    try:
        remaining = len(tasks)
        while remaining:
            key, event = await queue.get()
            if event is None:
                remaining -= 1
            elif isinstance(event, Exception):
                raise event
            else:
                yield key, event
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
