"""OpenAI-style error bodies, the app's exception handlers and the API-key middleware."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvferry.engine.async_engine import RequestFailedError
from kvferry.engine.core_protocol import EngineDeadError
from kvferry.entrypoints.edge import validation_message
from kvferry.entrypoints.http_common import CLIENT_CLOSED_STATUS, ClientDisconnected, error_body
from kvferry.errors import InvalidRequestError, KVFerryError, ModelNotFoundError

__all__ = [
    "error_body",
    "error_response",
    "exception_body",
    "exception_response",
    "install_error_handlers",
]

logger = logging.getLogger(__name__)


def error_response(
    status: int, message: str, err_type: str, param: str | None = None, code: str | int | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, param, code), status_code=status)


def exception_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(HTTP status, OpenAI error body) for an exception raised while serving a request."""
    if isinstance(exc, InvalidRequestError):
        code = "model_not_found" if isinstance(exc, ModelNotFoundError) else None
        return exc.status_code, error_body(exc.message, exc.error_type, exc.param, code)
    if isinstance(exc, EngineDeadError):
        return 503, error_body(str(exc), "service_unavailable_error")
    if isinstance(exc, RequestFailedError):
        return 500, error_body(str(exc), "server_error")
    logger.error("internal error while serving a request", exc_info=exc)
    return 500, error_body(f"internal server error: {type(exc).__name__}", "server_error")


def exception_response(exc: BaseException) -> JSONResponse:
    status, body = exception_body(exc)
    return JSONResponse(body, status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    return validation_message(list(exc.errors()))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), err_type)

    @app.exception_handler(ClientDisconnect)
    async def _on_disconnect(request: Request, _: ClientDisconnect) -> Response:
        # The client left while its body was being read (a proxy dropping an aborted
        # client's upstream call): nothing to answer, nothing went wrong here.
        logger.info("%s %s: the client left before its request was read", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED_STATUS)

    @app.exception_handler(ClientDisconnected)
    async def _on_client_gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_STATUS)  # logged where it was seen

    async def _on_exception(_: Request, exc: Exception) -> JSONResponse:
        return exception_response(exc)

    # Typed errors get their own registration: handled as answers, not logged as crashes
    # (starlette's handler for Exception itself re-raises after answering).
    app.add_exception_handler(KVFerryError, _on_exception)
    app.add_exception_handler(Exception, _on_exception)
