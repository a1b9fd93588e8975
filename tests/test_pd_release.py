"""Releasing a prefill nobody will read: POST /v1/kv_transfer/release and the proxy.

Over the fake core: the endpoint's contract (API key, then the proxy's credential: 403 for
anyone else whatever the id; 400 for a bad body; idempotent 200, the same for an id that
holds nothing here), and kv_transfer_params likewise the proxy's alone. With real processes: a
`kvferry serve` prefiller (NixlConnector, 30 s leases) behind the proxy, whose decoder
never answers; a client that leaves once the prefill is done (non-streamed: while the
proxy waits for the decoder; streamed: after the early first token) gets the prefiller's
pool back to all free within seconds, not at lease expiry, whether the prefiller
transfers whole requests or streams them layer by layer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvferry.entrypoints.openai.server import build_app as build_server
from kvferry.entrypoints.proxy.app import build_app as build_proxy
from kvferry.entrypoints.proxy.config import ProxyConfig
from kvferry.entrypoints.proxy_secret import PROXY_SECRET_HEADER, ProxyCredential
from tests import plain_http
from tests.pd_support import MODEL as PD_MODEL
from tests.pd_support import Server, nixl, start_server, stop, wait_healthy, wait_idle
from tests.proxy_fakes import serve_in_thread as serve_app
from tests.test_server_api import KEY, MODEL, make_engine

RELEASE = "/v1/kv_transfer/release"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROXY_SECRET = "the-proxy-secret-0123456789"
AS_PROXY = {**AUTH, PROXY_SECRET_HEADER: PROXY_SECRET}
LEASE_S = 30.0
PROMPT, FIRST_TEXT = "Count from 3 to ten.", " hungry"  # the tiny llama's greedy first token


def test_release_endpoint_contract(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    app = build_server(engine, MODEL, api_key=KEY, proxy=ProxyCredential(PROXY_SECRET))
    try:
        with (
            serve_app(app) as url,
            httpx.Client(base_url=url, headers=AS_PROXY, timeout=10) as proxy,
            httpx.Client(base_url=url, headers=AUTH, timeout=10) as client,
        ):
            assert plain_http.post(url + RELEASE, json={"request_id": "x"}).status_code == 401
            for bad in ({}, {"request_id": 5}, {"request_id": ""}):
                assert proxy.post(RELEASE, json=bad).status_code == 400, bad
            body = {"model": MODEL, "prompt": [400], "max_tokens": 1}
            asked = {**body, "kv_transfer_params": {"do_remote_decode": True}}
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            for path, request in (("/v1/completions", asked), ("/v1/chat/completions", {**chat, **asked})):
                refused = client.post(path, json=request)  # the API key is not enough
                assert refused.status_code == 403, refused.text
                assert refused.json()["error"]["param"] == "kv_transfer_params"
                wrong = client.post(path, json=request, headers={PROXY_SECRET_HEADER: "x" + PROXY_SECRET})
                assert wrong.status_code == 403
            kept = proxy.post("/v1/completions", json=asked).json()["id"]
            plain = client.post("/v1/completions", json=body).json()["id"]
            # anyone but the proxy: the same refusal for a held id and one that holds nothing
            foreign = client.post(RELEASE, json={"request_id": f"{kept}-0"})
            unknown = client.post(RELEASE, json={"request_id": "cmpl-nobody-0"})
            assert foreign.status_code == unknown.status_code == 403
            assert foreign.json() == unknown.json() and "proxy" in foreign.json()["error"]["message"]
            # the proxy: the same answer for an id held, not held, or never seen; idempotent
            for request_id in (f"{kept}-0", f"{kept}-0", f"{plain}-0", "cmpl-nobody-0"):
                resp = proxy.post(RELEASE, json={"request_id": request_id})
                assert resp.status_code == 200 and resp.json() == {"request_id": request_id, "released": True}
    finally:
        engine.shutdown()


def stalled_decoder() -> FastAPI:
    """A decode instance that is healthy but never answers a request."""
    app = FastAPI()
    app.state.requests = 0

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        app.state.requests += 1
        await asyncio.sleep(3600)
        return JSONResponse({})

    return app


@pytest.fixture(scope="module", params=["whole", "layerwise"])
def deployment(
    request: pytest.FixtureRequest, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, str, FastAPI]]:
    """(the prefill server, the proxy's URL, the stalled decoder's app); the prefiller
    transfers whole requests, or streams them layer by layer (the proxy then sends the
    decode leg with the prefill, and releases once the prefill's own answer names its KV)."""
    logs = tmp_path_factory.mktemp("pd_release")
    kv = nixl("producer", lease_s=LEASE_S, layerwise=request.param == "layerwise")
    secret = logs / "kv-secret"  # an instance with an API key refuses an unauthenticated side channel
    secret.write_text("a-shared-side-channel-secret")
    proxy_secret = logs / "proxy-secret"  # and one with a connector needs the proxy's credential
    proxy_secret.write_text(PROXY_SECRET)
    args = ("--api-key", KEY, "--metrics-public", "--kv-transfer-secret-file", str(secret))
    args += ("--proxy-secret-file", str(proxy_secret))
    prefiller = start_server(tiny_llama, logs, "prefill", kv, args=args)
    decoder = stalled_decoder()
    try:
        wait_healthy([prefiller])
        with serve_app(decoder) as decode_url:
            config = ProxyConfig(
                (prefiller.url,),
                (decode_url,),
                api_key=KEY,
                health_interval_s=60.0,
                proxy_secret=PROXY_SECRET,
            )
            with serve_app(build_proxy(config)) as proxy_url:
                yield prefiller, proxy_url, decoder
    finally:
        codes = stop([prefiller])
    assert codes == [0], prefiller.tail()


def held_blocks(server: Server) -> float:
    m = server.metrics()
    return m["num_blocks"] - m["num_free_blocks"] if m["num_requests_running"] == 0 else 0.0


async def leave_after_the_prefill(
    proxy_url: str, prefiller: Server, stream: bool, decode_started: Callable[[], bool]
) -> None:
    """Send a request through the proxy and hang up once the prefill is done and the decode
    leg has reached the decoder: streamed, at the prefiller's token (sent early, possibly
    before the proxy calls the decoder: a loaded host once hung up in between); else once
    the prefiller holds the prompt's KV."""
    body = {"model": PD_MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": stream}
    early = asyncio.Event()
    async with httpx.AsyncClient(headers=AUTH, timeout=60) as http:

        async def ask() -> None:
            async with http.stream("POST", proxy_url + "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        assert json.loads(line[6:])["choices"][0]["text"] == FIRST_TEXT
                        early.set()

        async def prefilled() -> bool:
            done = early.is_set() if stream else bool(await asyncio.to_thread(held_blocks, prefiller))
            return done and decode_started()

        task = asyncio.ensure_future(ask())
        deadline = time.monotonic() + 60
        while not await prefilled():
            assert time.monotonic() < deadline and not task.done(), "the prefill did not finish"
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.slow  # a prefill server and a proxy
@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_between_prefill_and_decode_frees_the_prefill(deployment, stream: bool) -> None:
    prefiller, proxy_url, decoder = deployment
    seen = decoder.state.requests
    start = time.monotonic()
    asyncio.run(leave_after_the_prefill(proxy_url, prefiller, stream, lambda: decoder.state.requests > seen))
    wait_idle(prefiller, timeout=LEASE_S / 3)
    assert time.monotonic() - start < LEASE_S / 3
    assert decoder.state.requests == seen + 1  # the decode leg had started, and stalled
    assert prefiller.metrics().get("kv_connector_nixl_expired_leases", 0.0) == 0.0
