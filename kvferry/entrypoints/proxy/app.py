"""The proxy's FastAPI app: OpenAI routes, /health, /metrics.

POST /v1/completions, /v1/chat/completions   prefill, then decode (SSE when "stream": true)
GET  /v1/models                              a decode instance's answer
GET  /health                                 200 while each role has a healthy instance; instances up/down
                                             per role, each instance's health, last error and restarts
GET  /metrics                                the proxy's Prometheus metrics
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import httpx
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvferry.entrypoints.edge import BodyDecoder
from kvferry.entrypoints.edge_options import protected_paths
from kvferry.entrypoints.http_common import (
    CLIENT_CLOSED_STATUS,
    ApiKeyMiddleware,
    ClientDisconnected,
    error_body,
    until_disconnect,
)
from kvferry.entrypoints.proxy.config import ProxyConfig, normalize_url
from kvferry.entrypoints.proxy.errors import ProxyError, install_error_handlers
from kvferry.entrypoints.proxy.health import health_loop
from kvferry.entrypoints.proxy.kv_event_feed import EventFeed, EventSource, follow_all
from kvferry.entrypoints.proxy.metrics import ProxyMetrics
from kvferry.entrypoints.proxy.pd import CHAT, COMPLETIONS, ProxyContext, complete
from kvferry.entrypoints.proxy.pool import Instance, InstancePool, Policy, make_policy
from kvferry.entrypoints.proxy.prefix_route import PrefixRouting, prefix_routing
from kvferry.entrypoints.proxy.streaming import open_stream
from kvferry.entrypoints.proxy.upstream import Upstream
from kvferry.entrypoints.proxy.validate import checked_body
from kvferry.entrypoints.proxy_secret import proxy_headers
from kvferry.errors import InvalidRequestError

logger = logging.getLogger(__name__)

T = TypeVar("T")
FORWARDED_HEADERS = ("authorization", "x-request-id")


def make_context(
    config: ProxyConfig, client: httpx.AsyncClient, routing: PrefixRouting | None = None
) -> ProxyContext:
    def policy() -> Policy:
        if routing is not None:
            return routing.policy(config.prefix_load_tokens)
        return make_policy(config.policy)

    prefill = InstancePool("prefill", [normalize_url(u) for u in config.prefill_urls], policy())
    decode = InstancePool("decode", [normalize_url(u) for u in config.decode_urls], policy())
    metrics = ProxyMetrics([prefill, decode], None if routing is None else routing.index.num_blocks)
    return ProxyContext(
        prefill,
        decode,
        Upstream(client, metrics),
        metrics,
        config.early_first_token,
        prompt_hasher=None if routing is None else routing.hasher,
        prefix_index=None if routing is None else routing.index,
        local_prefill_tokens=config.local_prefill_tokens,
        idle_decoder_prefills=config.idle_decoder_prefills,
        local_on_prefillers=config.local_on_prefillers,
    )


def make_prefix_routing(config: ProxyConfig) -> PrefixRouting | None:
    """--policy prefix: the instances' tokenizer, the index and where their events come from."""
    if config.policy != "prefix" or config.tokenizer is None:
        return None
    sources = [
        EventSource.parse(normalize_url(url), spec)
        for urls, specs in (
            (config.prefill_urls, config.prefill_kv_events),
            (config.decode_urls, config.decode_kv_events),
        )
        for url, spec in zip(urls, specs, strict=False)
    ]
    return prefix_routing(config.tokenizer, config.block_size, sources)


def make_client(config: ProxyConfig) -> httpx.AsyncClient:
    timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
    limits = httpx.Limits(
        max_connections=config.max_connections,
        max_keepalive_connections=256,
        keepalive_expiry=config.keepalive_expiry_s,
    )
    # The proxy's credential rides on every request to an instance (proxy_secret.py).
    return httpx.AsyncClient(timeout=timeout, limits=limits, headers=proxy_headers(config.proxy_secret))


def build_app(config: ProxyConfig) -> FastAPI:
    """The proxy app for ``config``; its httpx client and health checks live with the app."""
    client = make_client(config)
    routing = make_prefix_routing(config)
    ctx = make_context(config, client, routing)
    decoder = BodyDecoder(config.limits)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        checks = asyncio.create_task(
            health_loop(client, ctx.pools, config.health_interval_s, config.health_timeout_s)
        )
        zmq_ctx = zmq.asyncio.Context()
        feeds = asyncio.create_task(follow_all(_feeds(ctx, routing, zmq_ctx)))
        try:
            yield
        finally:
            checks.cancel()
            feeds.cancel()
            await asyncio.gather(checks, feeds, return_exceptions=True)
            zmq_ctx.term()
            await ctx.cancel_background()
            await client.aclose()
            decoder.close()

    app = FastAPI(title="kvferry proxy", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.proxy = ctx
    install_error_handlers(app)
    if config.api_key is not None:
        app.add_middleware(
            ApiKeyMiddleware, api_key=config.api_key, protected=protected_paths(config.metrics_public)
        )
    _add_openai_routes(app, ctx, decoder)
    _add_ops_routes(app, ctx, routing)
    return app


def _add_openai_routes(app: FastAPI, ctx: ProxyContext, decoder: BodyDecoder) -> None:
    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await _generate(ctx, COMPLETIONS, request, decoder)

    @app.post(CHAT)
    async def chat(request: Request) -> Response:
        return await _generate(ctx, CHAT, request, decoder)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return JSONResponse(await ctx.upstream.get_json(ctx.decode, "/v1/models", _forwarded(request)))


def _add_ops_routes(app: FastAPI, ctx: ProxyContext, routing: PrefixRouting | None) -> None:
    @app.get("/health")
    async def health() -> Response:
        state = {pool.role: [_described(i, routing) for i in pool.instances] for pool in ctx.pools}
        counts = {p.role: {"up": p.num_healthy, "down": len(p.instances) - p.num_healthy} for p in ctx.pools}
        missing = [pool.role for pool in ctx.pools if pool.num_healthy == 0]
        if missing:
            body = error_body(f"no healthy {' or '.join(missing)} instance", "service_unavailable_error")
            return JSONResponse({**body, "roles": counts, "instances": state}, status_code=503)
        return JSONResponse({"status": "ok", "roles": counts, "instances": state})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _feeds(ctx: ProxyContext, routing: PrefixRouting | None, zmq_ctx: zmq.asyncio.Context) -> list[EventFeed]:
    """One event feed per instance that publishes KV events; each learns of its restarts."""
    if routing is None:
        return []
    instances = {inst.url: inst for pool in ctx.pools for inst in pool.instances}
    return [
        EventFeed(s, routing.index, zmq_ctx, runs=_restarts_of(instances[s.url])) for s in routing.sources
    ]


def _restarts_of(inst: Instance) -> Callable[[], int]:
    return lambda: inst.restarts


def _described(inst: Instance, routing: PrefixRouting | None) -> dict[str, Any]:
    """An instance's state; with --policy prefix, the blocks the index knows it holds."""
    described = inst.describe()
    if routing is not None:
        described["cached_blocks"] = routing.index.num_blocks(inst.url)
    return described


async def _generate(ctx: ProxyContext, path: str, request: Request, decoder: BodyDecoder) -> Response:
    start = time.monotonic()
    status = 200
    try:
        body = await checked_body(request, path, decoder)
        headers = _forwarded(request)
        if body.get("stream"):
            events = await until_disconnect(request, open_stream(ctx, path, body, headers, start))
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(await until_disconnect(request, complete(ctx, path, body, headers)))
    except ClientDisconnected:
        status = CLIENT_CLOSED_STATUS
        return Response(status_code=status)
    except (ProxyError, InvalidRequestError) as exc:
        status = exc.status_code
        raise
    except Exception:
        status = 500
        raise
    finally:
        ctx.metrics.request(path, status)


def _forwarded(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
