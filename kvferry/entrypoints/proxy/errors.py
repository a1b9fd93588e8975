"""Typed proxy errors, OpenAI error bodies, and the app's exception handlers."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvferry.entrypoints.http_common import error_body
from kvferry.errors import InvalidRequestError, KVFerryError

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


class InstanceLostError(UpstreamUnavailableError):
    """An instance closed the connection before answering and no longer accepts one: it
    died holding the request (a keep-alive expiry would let the request be sent again)."""


class NoHealthyInstanceError(ProxyError):
    """Every instance of a role is marked unhealthy: HTTP 503."""

    status_code = 503
    error_type = "service_unavailable_error"


class UpstreamTimeoutError(ProxyError):
    """An instance stopped answering for longer than the read timeout: HTTP 504."""

    status_code = 504
    error_type = "gateway_timeout"


# An instance's refusals the client should see as they are (its own request's fault, or a
# load the client may retry later); any other status is the instance's failure: 502.
PASSED_STATUSES = frozenset({400, 401, 403, 404, 409, 413, 415, 422, 429, 503})


class UpstreamHTTPError(ProxyError):
    """An instance answered with an error: a refusal (PASSED_STATUSES) with an OpenAI body
    goes to the client unchanged; anything else is a 502 naming the instance."""

    def __init__(self, status_code: int, content: bytes, role: str, url: str) -> None:
        self.upstream_status = status_code
        self.status_code = status_code if status_code in PASSED_STATUSES else 502
        self.content = content
        self.role = role
        self.url = url
        super().__init__(f"{role} instance {url} answered HTTP {status_code}")

    def body(self) -> dict[str, Any]:
        try:
            parsed = json.loads(self.content)
        except ValueError:
            parsed = None
        openai_shaped = isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)
        if isinstance(parsed, dict) and openai_shaped and self.status_code == self.upstream_status:
            return parsed
        if openai_shaped:
            detail = str(parsed["error"].get("message"))[:500]
            return error_body(f"{self.message}: {detail}", "bad_gateway")
        text = self.content.decode("utf-8", "replace")[:500]
        return error_body(
            f"{self.message}: {text}", "upstream_error" if self.status_code < 500 else "bad_gateway"
        )

    def response(self) -> Response:
        body = self.body()
        return JSONResponse(body, status_code=self.status_code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProxyError)
    async def _on_proxy_error(_: Request, exc: ProxyError) -> Response:
        if not isinstance(exc, UpstreamHTTPError):
            logger.warning("request failed: %s", exc.message)
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def _on_invalid(_: Request, exc: InvalidRequestError) -> Response:
        return JSONResponse(error_body(exc.message, exc.error_type, exc.param), exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> Response:
        err_type = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), err_type), exc.status_code, headers=exc.headers)

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
