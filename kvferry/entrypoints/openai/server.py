"""The OpenAI-compatible HTTP server: ``build_app`` (FastAPI) and ``run_server`` (uvicorn).

    /v1/completions, /v1/chat/completions   (SSE when "stream": true)
    /v1/kv_transfer/release                  free the KV kept for a remote decoder now
    /v1/kv_transfer/source                   how decoders stream this instance's prefills (layer-wise)
    /v1/models, /health, /metrics (Prometheus text)

``kv_transfer_params`` in a request and the release route are the proxy's alone: with a
proxy secret set they need its credential (proxy_secret.py), not just the API key.

The engine core runs in its own process (AsyncEngine), so request handling, tokenizing
and detokenizing here never stall the engine loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from types import FrameType
from typing import Any, TypeVar

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from kvferry.config import EngineConfig
from kvferry.engine.async_engine import AsyncEngine
from kvferry.engine.core_client import CoreStart
from kvferry.engine.core_protocol import EngineDeadError
from kvferry.entrypoints.edge import BodyDecoder, check_prompt_lengths, parse_model
from kvferry.entrypoints.edge_http import StrictH11Protocol
from kvferry.entrypoints.edge_options import EdgeLimits, protected_paths
from kvferry.entrypoints.http_common import ApiKeyMiddleware
from kvferry.entrypoints.openai.errors import exception_response, install_error_handlers
from kvferry.entrypoints.openai.metrics import make_registry
from kvferry.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, KVReleaseRequest
from kvferry.entrypoints.openai.serving_chat import create_chat_completion
from kvferry.entrypoints.openai.serving_common import ServerState
from kvferry.entrypoints.openai.serving_completions import create_completion
from kvferry.entrypoints.proxy_secret import ProxyCredential
from kvferry.errors import UnknownRequestError

logger = logging.getLogger(__name__)

METRICS_REFRESH_TIMEOUT_S = 1.0
M = TypeVar("M", bound=BaseModel)


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    limits: EdgeLimits | None = None,
    metrics_public: bool = False,
    proxy: ProxyCredential | None = None,
) -> FastAPI:
    """A FastAPI app serving ``engine`` under ``served_model_name``.

    With ``api_key`` set, /v1/* needs it, and so do /metrics and /openapi.json unless
    ``metrics_public``. Request bodies are read and checked by kvferry/entrypoints/edge.py
    within ``limits``. ``proxy``: the credential kv_transfer_params and releases need.
    """
    decoder = BodyDecoder(limits)
    max_model_len = engine.model_config.max_model_len
    credential = proxy or ProxyCredential()
    app = FastAPI(title="kvferry", docs_url=None, redoc_url=None)
    state = ServerState(engine, served_model_name, aliases=(engine.model_config.model,))
    created = int(time.time())
    install_error_handlers(app)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, protected=protected_paths(metrics_public))
    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def models() -> dict[str, object]:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "kvferry",
            "root": served_model_name,  # never the filesystem path
            "max_model_len": engine.model_config.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = await decoder.read(request, partial(_checked, CompletionRequest, max_model_len))
        _check_kv_params(credential, request, body.kv_transfer_params)
        return await create_completion(body, request, state)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await decoder.read(request, partial(_checked, ChatCompletionRequest, max_model_len))
        _check_kv_params(credential, request, body.kv_transfer_params)
        return await create_chat_completion(body, request, state)

    @v1.post("/kv_transfer/release")
    async def release_kv(request: Request) -> dict[str, object]:
        """Free the KV kept for a finished prefill whose decoder will not come. The proxy
        calls it when its client leaves between the two legs; only the proxy may (403
        otherwise, whatever the id). Idempotent, and the same answer for an id that holds
        nothing here: the answer tells nobody which requests exist."""
        credential.require(request.headers, "releasing KV")
        body = await decoder.read(request, partial(parse_model, KVReleaseRequest))
        try:
            engine.release_kv(body.request_id)
        except UnknownRequestError:
            pass
        return {"request_id": body.request_id, "released": True}

    @v1.get("/kv_transfer/source")
    async def kv_transfer_source(request: Request) -> Response:
        """Layer-wise P/D: the params (less the transfer id) a decode request streams this
        instance's prefills with; 404 if its connector does not stream them. The proxy's alone."""
        credential.require(request.headers, "the KV transfer source")
        source = engine.kv_stream_source
        if source is None:
            raise UnknownRequestError("this instance does not stream its prefills (layer-wise KV transfer)")
        return JSONResponse({"kv_transfer_params": source})

    app.include_router(v1)
    _add_ops_routes(app, engine, served_model_name)
    return app


def _checked(model: type[M], max_model_len: int, value: Any) -> M:
    """A generation request's body as ``model``, a prompt too long for the context refused first."""
    return parse_model(model, check_prompt_lengths(value, max_model_len))


def _check_kv_params(proxy: ProxyCredential, request: Request, params: dict[str, Any] | None) -> None:
    if params is not None:
        proxy.require(request.headers, "kv_transfer_params", "kv_transfer_params")


def _add_ops_routes(app: FastAPI, engine: AsyncEngine, served_model_name: str) -> None:
    registry = make_registry(engine, served_model_name)
    # Names this run of the server in /health: a proxy that sees it change counts a restart.
    instance_id = secrets.token_hex(8)

    @app.get("/health")
    async def health() -> Response:
        try:
            engine.check_health()
        except EngineDeadError as exc:
            return exception_response(exc)
        return JSONResponse({"status": "ok", "instance_id": instance_id})

    @app.get("/metrics")
    async def metrics() -> Response:
        if not engine.is_dead:
            await engine.refresh_stats(METRICS_REFRESH_TIMEOUT_S)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@dataclass(frozen=True)
class HttpOptions:
    """How the server meets clients: address, API key and what it guards, body limits."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    metrics_public: bool = False
    limits: EdgeLimits = field(default_factory=EdgeLimits)
    proxy_secret: str | None = None  # kv_transfer_params and releases need it (proxy_secret.py)


def run_server(
    engine_config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    options: HttpOptions | None = None,
    core_start: CoreStart = CoreStart.SPAWN,
) -> None:
    """Start the engine core process (forked only where this process computed nothing:
    kvferry serve), then serve HTTP until SIGINT/SIGTERM; stop both.

    On the signal the server stops accepting, ends open requests with HTTP 503 (an error
    event in a stream), stops the engine core and returns. A signal while the model loads
    stops the loading core and returns as well.
    """
    options = options or HttpOptions(host, port, api_key)
    with _signals_raise_stop():
        try:
            _serve(engine_config, options, log_level, core_start)
        except _StopRequested as stop:
            logger.info("%s: server stopped", stop)


def _serve(engine_config: EngineConfig, options: HttpOptions, log_level: str, core_start: CoreStart) -> None:
    engine = AsyncEngine.from_config(engine_config, start=core_start)
    name = engine_config.model.served_model_name
    host, port = options.host, options.port
    try:
        proxy = ProxyCredential(options.proxy_secret)
        app = build_app(engine, name, options.api_key, options.limits, options.metrics_public, proxy)
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=5,
            http=StrictH11Protocol,
        )
        logger.info("serving %s on http://%s:%d", name, host, port)
        _Server(config, on_exit=engine.stop).run()
    finally:
        engine.shutdown()


class _StopRequested(Exception):
    """SIGINT or SIGTERM outside uvicorn's serving loop."""


@contextlib.contextmanager
def _signals_raise_stop() -> Iterator[None]:
    """SIGINT/SIGTERM raise _StopRequested while the engine loads and once uvicorn is done.

    While serving, uvicorn handles the signals itself; after its graceful shutdown it
    raises the signal again for the handler it replaced, which is this one.
    """
    if threading.current_thread() is not threading.main_thread():  # signals go to the main thread
        yield
        return

    def raise_stop(signum: int, _frame: object) -> None:
        raise _StopRequested(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Server(uvicorn.Server):
    """uvicorn's server that calls ``on_exit`` (on its event loop) as soon as a signal stops it.

    uvicorn then stops accepting and waits for open requests; a generation can take far
    longer than any grace period, so ``on_exit`` ends them at once with a clean error.
    """

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None:  # a signal handler: hand the work to the loop
            self._loop.call_soon_threadsafe(self._on_exit)
