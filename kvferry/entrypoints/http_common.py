"""HTTP pieces the OpenAI server and the P/D proxy share: error bodies, API key, disconnects.

Kept free of engine imports so the proxy starts without torch.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

T = TypeVar("T")


def error_body(message: str, err_type: str, param: str | None = None, code: str | int | None = None) -> dict:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class ApiKeyMiddleware:
    """Pure ASGI middleware: /v1/* needs ``Authorization: Bearer <api_key>``, else HTTP 401.

    It runs before routing and body parsing, so a bad key never reaches a handler.
    """

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
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


class ClientDisconnected(Exception):
    """The HTTP client went away before its (non-streaming) answer was ready."""


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
