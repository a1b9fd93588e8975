"""Calls to instances over one pooled httpx.AsyncClient.

A refused connection (nothing was sent) marks the instance unhealthy and the request
goes to the next healthy instance of the role (counted in ``requests_moved``). A pooled
keep-alive connection the instance closed meanwhile (it answered nothing: no status line)
is not a failure: the request goes again to the same instance on another connection (up
to STALE_RETRIES times). An instance silent for longer than the read timeout is a 504;
any other failure is a 502 at once. An instance's error answer becomes an
``UpstreamHTTPError`` carrying its status and body.
Streams are parsed by their SSE framing (sse.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx

from kvferry.entrypoints.proxy.errors import (
    InstanceLostError,
    UpstreamHTTPError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
)
from kvferry.entrypoints.proxy.metrics import MoveCause, ProxyMetrics
from kvferry.entrypoints.proxy.pool import Instance, InstancePool
from kvferry.entrypoints.proxy.prefix_index import RouteKey
from kvferry.entrypoints.proxy.sse import sse_data

logger = logging.getLogger(__name__)

UPSTREAM_OUTCOME = {MoveCause.LOST: "lost", MoveCause.REFUSED: "connect_error"}
SSE_DONE = object()  # what iter_sse yields for "data: [DONE]"
RELEASE_KV_PATH = "/v1/kv_transfer/release"
RELEASE_TIMEOUT_S = 5.0
RELEASE_ATTEMPTS = 4
RELEASE_BACKOFF_S = 0.25
STALE_RETRIES = 2
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout)
# Before the status line: the instance closed a pooled connection (keep-alive expiry) as
# the request was sent on it; the request was not answered, so it may be sent again.
_STALE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class UpstreamStream:
    """An open SSE response from one instance; ``aclose`` drops the connection (aborting it)."""

    def __init__(self, pool: InstancePool, inst: Instance, response: httpx.Response) -> None:
        self.pool = pool
        self.instance = inst
        self.response = response
        self._closed = False

    async def events(self) -> AsyncIterator[Any]:
        """Parsed JSON payloads of ``data:`` lines, then SSE_DONE."""
        try:
            async for data in sse_data(self.response.aiter_text()):
                if data.strip() == "[DONE]":
                    yield SSE_DONE
                    return
                yield self._parse(data)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeoutError(
                f"{self.pool.role} instance {self.instance.url} sent nothing for too long: {type(exc).__name__}"
            ) from exc
        except httpx.HTTPError as exc:
            raise UpstreamUnavailableError(
                f"{self.pool.role} instance {self.instance.url} broke the stream: {type(exc).__name__}: {exc}"
            ) from exc
        raise UpstreamUnavailableError(
            f"{self.pool.role} instance {self.instance.url} ended the stream early"
        )

    def _parse(self, data: str) -> Any:
        try:
            return json.loads(data)
        except ValueError as exc:
            raise UpstreamUnavailableError(
                f"{self.pool.role} instance {self.instance.url} sent an event that is not JSON: {data[:200]!r}"
            ) from exc

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.response.aclose()
        finally:
            self.pool.release(self.instance)


class Upstream:
    def __init__(self, client: httpx.AsyncClient, metrics: ProxyMetrics) -> None:
        self.client = client
        self.metrics = metrics

    async def post_json(
        self,
        pool: InstancePool,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        move_when_lost: bool = True,
        route: RouteKey | None = None,
        first: Instance | None = None,
    ) -> tuple[Instance, dict[str, Any]]:
        """POST ``body`` to an instance of ``pool``; its JSON answer (HTTP 200 only).
        ``route``: the prompt, for a policy that places requests by where their KV is;
        ``first``: the instance to try first, already acquired from ``pool``."""
        inst, resp = await self._send(pool, "POST", path, body, headers, False, move_when_lost, route, first)
        try:
            data = resp.json()
        except ValueError as exc:
            raise UpstreamUnavailableError(f"{pool.role} instance {inst.url} sent a non-JSON answer") from exc
        if not isinstance(data, dict):
            raise UpstreamUnavailableError(f"{pool.role} instance {inst.url} sent a non-object answer")
        return inst, data

    async def post_pinned(
        self, pool: InstancePool, inst: Instance, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        """POST to ``inst`` alone (acquired by the caller; released here): no other instance
        may take the request. Its JSON answer (HTTP 200 only)."""
        try:
            resp = await self._attempt(pool, inst, "POST", path, body, headers, False)
        except (*_RETRYABLE, InstanceLostError) as exc:
            pool.mark(inst, False, f"{type(exc).__name__}: {exc}")
            raise UpstreamUnavailableError(f"{pool.role} instance {inst.url} failed: {exc}") from exc
        finally:
            pool.release(inst)
        data = json.loads(resp.content or b"{}")
        return data if isinstance(data, dict) else {}

    async def release_kv(
        self, pool: InstancePool, inst: Instance, request_id: str, headers: dict[str, str]
    ) -> None:
        """Ask ``inst`` to free the KV it keeps for ``request_id``, again after a transport
        error or a 5xx (RELEASE_ATTEMPTS in all, backing off); a final failure is only logged
        (the instance's lease frees the KV in the end)."""
        for attempt in range(RELEASE_ATTEMPTS):
            if attempt:
                await asyncio.sleep(RELEASE_BACKOFF_S * 2 ** (attempt - 1))
            if await self._release_once(pool, inst, request_id, headers):
                return

    async def _release_once(
        self, pool: InstancePool, inst: Instance, request_id: str, headers: dict[str, str]
    ) -> bool:
        """One release request; whether it is settled (done, or refused for good)."""
        url = inst.url + RELEASE_KV_PATH
        try:
            resp = await self._post_idempotent(url, {"request_id": request_id}, headers)
        except httpx.HTTPError as exc:
            self.metrics.upstream(pool.role, inst.url, "error")
            logger.warning(
                "could not release %s on %s: %s: %s", request_id, inst.url, type(exc).__name__, exc
            )
            return False
        self.metrics.upstream(pool.role, inst.url, str(resp.status_code))
        if resp.status_code != 200:
            logger.warning(
                "%s refused to release %s: HTTP %d %s", inst.url, request_id, resp.status_code, resp.text
            )
        return resp.status_code < 500

    async def _post_idempotent(
        self, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> httpx.Response:
        for attempt in range(STALE_RETRIES + 1):
            try:
                return await self.client.post(url, json=body, headers=headers, timeout=RELEASE_TIMEOUT_S)
            except _STALE:
                if attempt == STALE_RETRIES:
                    raise
        raise AssertionError("unreachable")

    async def get_json(self, pool: InstancePool, path: str, headers: dict[str, str]) -> dict[str, Any]:
        _, resp = await self._send(pool, "GET", path, None, headers, stream=False)
        answer: dict[str, Any] = resp.json()  # an instance's JSON object
        return answer

    async def open_stream(
        self,
        pool: InstancePool,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        route: RouteKey | None = None,
        move_when_lost: bool = True,
    ) -> UpstreamStream:
        """POST ``body`` with stream=true; an open stream once the instance answered HTTP 200
        (``move_when_lost``: as for ``_send``)."""
        inst, resp = await self._send(
            pool, "POST", path, body, headers, stream=True, move_when_lost=move_when_lost, route=route
        )
        return UpstreamStream(pool, inst, resp)

    async def _send(
        self,
        pool: InstancePool,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        headers: dict[str, str],
        stream: bool,
        move_when_lost: bool = True,
        route: RouteKey | None = None,
        first: Instance | None = None,
    ) -> tuple[Instance, httpx.Response]:
        """Try the pool's instances (``first``, acquired already, before the others) until
        one answers. One lost while holding the request is left like one that refused the
        connection, unless ``move_when_lost`` is false (the caller fails over itself): then
        InstanceLostError."""
        tried: list[Instance] = []
        while True:
            if first is not None:
                inst, first = first, None
            else:
                inst = pool.acquire(
                    exclude=tried, route=route
                )  # NoHealthyInstanceError (503) when none is left
            try:
                resp = await self._attempt(pool, inst, method, path, body, headers, stream)
            except (*_RETRYABLE, InstanceLostError) as exc:
                pool.release(inst)
                pool.mark(inst, False, f"{type(exc).__name__}: {exc}")
                cause = MoveCause.LOST if isinstance(exc, InstanceLostError) else MoveCause.REFUSED
                self.metrics.upstream(pool.role, inst.url, UPSTREAM_OUTCOME[cause])
                if cause is MoveCause.LOST and not move_when_lost:
                    raise
                tried.append(inst)
                if len(tried) == len(pool.instances) or pool.num_healthy == 0:
                    urls = ", ".join(i.url for i in tried)
                    raise UpstreamUnavailableError(
                        f"could not connect to any {pool.role} instance (tried {urls}): {exc}"
                    ) from exc
                self.metrics.moved(pool.role, cause)
                continue
            except BaseException:
                pool.release(inst)
                raise
            if not stream:
                pool.release(inst)
            return inst, resp

    async def _attempt(
        self,
        pool: InstancePool,
        inst: Instance,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        headers: dict[str, str],
        stream: bool,
    ) -> httpx.Response:
        try:
            resp = await self._send_fresh(pool, inst, method, path, body, headers)
            if resp.status_code != 200:
                content = await _read_all(resp)
                self.metrics.upstream(pool.role, inst.url, str(resp.status_code))
                raise UpstreamHTTPError(resp.status_code, content, pool.role, inst.url)
            if not stream:
                await _read_all(resp)
        except _RETRYABLE:
            raise
        except httpx.TimeoutException as exc:
            self.metrics.upstream(pool.role, inst.url, "timeout")
            raise UpstreamTimeoutError(
                f"{pool.role} instance {inst.url} did not answer in time: {type(exc).__name__}"
            ) from exc
        except httpx.HTTPError as exc:
            self.metrics.upstream(pool.role, inst.url, "error")
            raise UpstreamUnavailableError(
                f"{pool.role} instance {inst.url} failed: {type(exc).__name__}: {exc}"
            ) from exc
        self.metrics.upstream(pool.role, inst.url, "200")
        return resp

    async def _send_fresh(
        self,
        pool: InstancePool,
        inst: Instance,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        headers: dict[str, str],
    ) -> httpx.Response:
        """The response's status and headers; sent again on another connection when a pooled
        one turns out closed before any answer (see _STALE)."""
        for attempt in range(STALE_RETRIES + 1):
            request = self.client.build_request(method, inst.url + path, json=body, headers=headers)
            try:
                return await self.client.send(request, stream=True)
            except _RETRYABLE as exc:
                if attempt:  # it closed our connection, then refused a new one
                    raise InstanceLostError(f"{pool.role} instance {inst.url} was lost: {exc}") from exc
                raise
            except _STALE as exc:
                if attempt == STALE_RETRIES:
                    raise
                self.metrics.upstream(pool.role, inst.url, "stale_connection")
                logger.info("%s: %s before an answer; sending again", inst.url, type(exc).__name__)
        raise AssertionError("unreachable")


async def _read_all(resp: httpx.Response) -> bytes:
    """The body of a response opened as a stream, then the response closed."""
    try:
        return await resp.aread()
    finally:
        await resp.aclose()
