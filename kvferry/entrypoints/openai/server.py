"""The OpenAI-compatible HTTP server: ``build_app`` (FastAPI) and ``run_server`` (uvicorn).

    /v1/completions, /v1/chat/completions   (SSE when "stream": true)
    /v1/models, /health, /metrics (Prometheus text)

The engine core runs in its own process (AsyncEngine), so request handling, tokenizing
and detokenizing here never stall the engine loop.
"""

from __future__ import annotations

import logging
import time

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvferry.config import EngineConfig
from kvferry.engine.async_engine import AsyncEngine
from kvferry.engine.core_protocol import EngineDeadError
from kvferry.entrypoints.openai.errors import ApiKeyMiddleware, error_response, install_error_handlers
from kvferry.entrypoints.openai.metrics import make_registry
from kvferry.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvferry.entrypoints.openai.serving_chat import create_chat_completion
from kvferry.entrypoints.openai.serving_common import ServerState
from kvferry.entrypoints.openai.serving_completions import create_completion

logger = logging.getLogger(__name__)

METRICS_REFRESH_TIMEOUT_S = 1.0


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """A FastAPI app serving ``engine`` under ``served_model_name``; /v1/* needs ``api_key`` if set."""
    app = FastAPI(title="kvferry", docs_url=None, redoc_url=None)
    state = ServerState(engine, served_model_name)
    created = int(time.time())
    install_error_handlers(app)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def models() -> dict:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "kvferry",
            "root": engine.model_config.model,
            "max_model_len": engine.model_config.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, state)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, state)

    app.include_router(v1)
    _add_ops_routes(app, engine, served_model_name)
    return app


def _add_ops_routes(app: FastAPI, engine: AsyncEngine, served_model_name: str) -> None:
    registry = make_registry(engine, served_model_name)

    @app.get("/health")
    async def health() -> Response:
        try:
            engine.check_health()
        except EngineDeadError as exc:
            return error_response(503, str(exc), "service_unavailable_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        if not engine.is_dead:
            await engine.refresh_stats(METRICS_REFRESH_TIMEOUT_S)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def run_server(
    engine_config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
) -> None:
    """Start the engine core process, then serve HTTP until SIGINT/SIGTERM; stop both."""
    engine = AsyncEngine.from_config(engine_config)
    try:
        app = build_app(engine, engine_config.model.served_model_name, api_key)
        logger.info("serving %s on http://%s:%d", engine_config.model.served_model_name, host, port)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
