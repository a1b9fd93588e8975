"""Periodic GET /health on every instance; an unhealthy instance is skipped until it recovers.

A kvferry server's /health names its run (``instance_id``); a healthy answer from another
run than the last one counts a restart of that instance (``kvferry_proxy:instance_restarts``),
whoever restarted it (`kvferry disagg`'s supervisor, a process manager, a person)."""

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
        pool.seen_run(inst, _instance_id(resp))
    else:
        pool.mark(inst, False, f"/health answered HTTP {resp.status_code}")


def _instance_id(resp: httpx.Response) -> str | None:
    """The server run's id in a /health answer (kvferry serve's), if there is one."""
    try:
        body = resp.json()
    except ValueError:
        return None
    value = body.get("instance_id") if isinstance(body, dict) else None
    return value if isinstance(value, str) else None


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
