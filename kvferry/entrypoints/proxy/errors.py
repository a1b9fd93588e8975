"""Typed proxy errors, OpenAI error bodies, and the app's exception handlers."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvferry.entrypoints.http_common import error_body
from kvferry.errors import KVFerryError

logger = logging.getLogger(__name__)


class ProxyError(KVFerryError):
    """A request the proxy could not complete; carries its HTTP status and OpenAI body."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type)

    def response(self) -> Response:
        return JSONResponse(self.body(), status_code=self.status_code)


class BadRequestError(ProxyError):
    """The client's request cannot be proxied (not JSON, not an object)."""

    status_code = 400
    error_type = "invalid_request_error"


class UpstreamUnavailableError(ProxyError):
    """An instance could not be reached, or broke the connection: HTTP 502."""

    status_code = 502
    error_type = "bad_gateway"


class NoHealthyInstanceError(ProxyError):
    """Every instance of a role is marked unhealthy: HTTP 503."""

    status_code = 503
    error_type = "service_unavailable_error"


class UpstreamHTTPError(ProxyError):
    """An instance answered with an error: its status and body go to the client unchanged."""

    def __init__(self, status_code: int, content: bytes, role: str, url: str) -> None:
        self.status_code = status_code
        self.content = content
        self.role = role
        self.url = url
        super().__init__(f"{role} instance {url} answered HTTP {status_code}")

    def body(self) -> dict[str, Any]:
        try:
            parsed = json.loads(self.content)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            return parsed
        text = self.content.decode("utf-8", "replace")[:500]
        return error_body(f"{self.message}: {text}", "upstream_error")

    def response(self) -> Response:
        body = self.body()
        return JSONResponse(body, status_code=self.status_code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProxyError)
    async def _on_proxy_error(_: Request, exc: ProxyError) -> Response:
        if not isinstance(exc, UpstreamHTTPError):
            logger.warning("request failed: %s", exc.message)
        return exc.response()

    @app.exception_handler(Exception)
    async def _on_any(_: Request, exc: Exception) -> Response:
        logger.error("internal proxy error", exc_info=exc)
        return JSONResponse(error_body(f"internal proxy error: {type(exc).__name__}", "server_error"), 500)


def exception_event_body(exc: BaseException) -> dict[str, Any]:
    """The OpenAI error body for an exception raised inside a stream."""
    if isinstance(exc, ProxyError):
        return exc.body()
    logger.error("internal proxy error in a stream", exc_info=exc)
    return error_body(f"internal proxy error: {type(exc).__name__}", "server_error")
