"""Periodic GET /health on every instance; an unhealthy instance is skipped until it recovers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import httpx

from kvferry.entrypoints.proxy.pool import Instance, InstancePool

logger = logging.getLogger(__name__)


async def check_instance(
    client: httpx.AsyncClient, pool: InstancePool, inst: Instance, timeout: float
) -> None:
    try:
        resp = await client.get(inst.url + "/health", timeout=timeout)
    except httpx.HTTPError as exc:
        pool.mark(inst, False, f"health check failed: {type(exc).__name__}")
        return
    if resp.status_code == 200:
        pool.mark(inst, True)
    else:
        pool.mark(inst, False, f"/health answered HTTP {resp.status_code}")


async def check_all(client: httpx.AsyncClient, pools: Sequence[InstancePool], timeout: float) -> None:
    checks = [check_instance(client, pool, inst, timeout) for pool in pools for inst in pool.instances]
    await asyncio.gather(*checks)


async def health_loop(
    client: httpx.AsyncClient, pools: Sequence[InstancePool], interval: float, timeout: float
) -> None:
    """Check every instance now, then every ``interval`` seconds, until cancelled."""
    while True:
        try:
            await check_all(client, pools, timeout)
        except Exception:  # a bug here must not stop the checks
            logger.exception("health check round failed")
        await asyncio.sleep(interval)
