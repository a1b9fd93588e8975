"""Calls to instances over one pooled httpx.AsyncClient.

A refused connection (nothing was sent) marks the instance unhealthy and the request
goes to the next healthy instance of the role; any other failure is a 502 at once. An
instance's error answer becomes an ``UpstreamHTTPError`` carrying its status and body.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx

from kvferry.entrypoints.proxy.errors import UpstreamHTTPError, UpstreamUnavailableError
from kvferry.entrypoints.proxy.metrics import ProxyMetrics
from kvferry.entrypoints.proxy.pool import Instance, InstancePool

logger = logging.getLogger(__name__)

SSE_DONE = object()  # what iter_sse yields for "data: [DONE]"
RELEASE_KV_PATH = "/v1/kv_transfer/release"
RELEASE_TIMEOUT_S = 5.0
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout)


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
            async for line in self.response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    yield SSE_DONE
                    return
                yield json.loads(payload)
        except httpx.HTTPError as exc:
            raise UpstreamUnavailableError(
                f"{self.pool.role} instance {self.instance.url} broke the stream: {type(exc).__name__}: {exc}"
            ) from exc
        raise UpstreamUnavailableError(
            f"{self.pool.role} instance {self.instance.url} ended the stream early"
        )

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
        self, pool: InstancePool, path: str, body: dict, headers: dict[str, str]
    ) -> tuple[Instance, dict]:
        """POST ``body`` to an instance of ``pool``; its JSON answer (HTTP 200 only)."""
        inst, resp = await self._send(pool, "POST", path, body, headers, stream=False)
        try:
            data = resp.json()
        except ValueError as exc:
            raise UpstreamUnavailableError(f"{pool.role} instance {inst.url} sent a non-JSON answer") from exc
        if not isinstance(data, dict):
            raise UpstreamUnavailableError(f"{pool.role} instance {inst.url} sent a non-object answer")
        return inst, data

    async def release_kv(
        self, pool: InstancePool, inst: Instance, request_id: str, headers: dict[str, str]
    ) -> None:
        """Ask ``inst`` to free the KV it keeps for ``request_id``; failures are only logged
        (the instance's lease frees it in the end)."""
        url = inst.url + RELEASE_KV_PATH
        try:
            resp = await self.client.post(
                url, json={"request_id": request_id}, headers=headers, timeout=RELEASE_TIMEOUT_S
            )
        except httpx.HTTPError as exc:
            self.metrics.upstream(pool.role, inst.url, "error")
            logger.warning(
                "could not release %s on %s: %s: %s", request_id, inst.url, type(exc).__name__, exc
            )
            return
        self.metrics.upstream(pool.role, inst.url, str(resp.status_code))
        if resp.status_code != 200:
            logger.warning(
                "%s refused to release %s: HTTP %d %s", inst.url, request_id, resp.status_code, resp.text
            )

    async def get_json(self, pool: InstancePool, path: str, headers: dict[str, str]) -> dict:
        _, resp = await self._send(pool, "GET", path, None, headers, stream=False)
        return resp.json()

    async def open_stream(
        self, pool: InstancePool, path: str, body: dict, headers: dict[str, str]
    ) -> UpstreamStream:
        """POST ``body`` with stream=true; an open stream once the instance answered HTTP 200."""
        inst, resp = await self._send(pool, "POST", path, body, headers, stream=True)
        return UpstreamStream(pool, inst, resp)

    async def _send(
        self,
        pool: InstancePool,
        method: str,
        path: str,
        body: dict | None,
        headers: dict[str, str],
        stream: bool,
    ) -> tuple[Instance, httpx.Response]:
        tried: list[Instance] = []
        while True:
            inst = pool.acquire(exclude=tried)  # NoHealthyInstanceError (503) when none is left
            try:
                resp = await self._attempt(pool, inst, method, path, body, headers, stream)
            except _RETRYABLE as exc:
                pool.release(inst)
                pool.mark(inst, False, f"{type(exc).__name__}: {exc}")
                self.metrics.upstream(pool.role, inst.url, "connect_error")
                tried.append(inst)
                if len(tried) == len(pool.instances) or pool.num_healthy == 0:
                    urls = ", ".join(i.url for i in tried)
                    raise UpstreamUnavailableError(
                        f"could not connect to any {pool.role} instance (tried {urls}): {exc}"
                    ) from exc
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
        body: dict | None,
        headers: dict[str, str],
        stream: bool,
    ) -> httpx.Response:
        request = self.client.build_request(method, inst.url + path, json=body, headers=headers)
        try:
            resp = await self.client.send(request, stream=stream)
        except _RETRYABLE:
            raise
        except httpx.HTTPError as exc:
            self.metrics.upstream(pool.role, inst.url, "error")
            raise UpstreamUnavailableError(
                f"{pool.role} instance {inst.url} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            self.metrics.upstream(pool.role, inst.url, str(resp.status_code))
            raise UpstreamHTTPError(resp.status_code, content, pool.role, inst.url)
        self.metrics.upstream(pool.role, inst.url, "200")
        return resp
