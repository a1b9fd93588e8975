"""A decoder that dies holding a streamed leg's request, before answering, may have read the
prefill's KV (the prefiller then frees it): the leg starts over on another decoder without
the transfer's params (it computes the prompt), instead of handing that decoder params it
cannot load (a 500 and a failed answer, as a loaded CI host once showed)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvferry.entrypoints.proxy.errors import InstanceLostError
from kvferry.entrypoints.proxy.metrics import ProxyMetrics
from kvferry.entrypoints.proxy.pd import Prefilled, ProxyContext
from kvferry.entrypoints.proxy.pool import InstancePool, make_policy
from kvferry.entrypoints.proxy.streaming import StreamLeg

PARAMS = {"remote_request_id": "p-0", "first_token_id": 7, "remote_engine_id": "p"}


class LosingUpstream:
    """The first stream opened dies before answering; later ones open."""

    def __init__(self) -> None:
        self.opened: list[tuple[dict[str, Any], bool]] = []
        self.released: list[str] = []

    async def open_stream(self, pool, path, body, headers, route=None, move_when_lost=True):  # noqa: ANN001, ANN201
        self.opened.append((body, move_when_lost))
        if len(self.opened) == 1:
            raise InstanceLostError("decode instance http://d0 was lost")
        return object()

    async def release_kv(self, pool, inst, request_id, headers):  # noqa: ANN001, ANN201
        self.released.append(request_id)


def test_a_decoder_lost_before_answering_starts_the_leg_over_without_the_transferred_kv() -> None:
    prefill = InstancePool("prefill", ["http://p0"], make_policy("round_robin"))
    decode = InstancePool("decode", ["http://d0", "http://d1"], make_policy("round_robin"))
    upstream = LosingUpstream()
    ctx = ProxyContext(prefill, decode, upstream, ProxyMetrics([prefill, decode]))  # type: ignore[arg-type]
    body = {"model": "m", "prompt": "the cat", "max_tokens": 4, "stream": True}
    leg = StreamLeg(ctx, "/v1/completions", 0, body, {})
    leg.prefill = Prefilled(prefill.instances[0], {"kv_transfer_params": PARAMS})

    async def open_and_settle() -> object:
        stream = await leg._open_decoder()
        await asyncio.gather(*ctx.background)
        return stream

    assert asyncio.run(open_and_settle()) is not None
    (first, first_moves), (again, again_moves) = upstream.opened
    assert first["kv_transfer_params"] == PARAMS and not first_moves  # lost: not moved with the params
    assert "kv_transfer_params" not in again and again["return_token_ids"] and again_moves
    assert upstream.released == ["p-0"]  # the prefill's KV, if still held, is freed
    assert b'kvferry_proxy:decode_failovers_total{mode="stream"} 1.0' in _metrics(ctx)


def _metrics(ctx: ProxyContext) -> bytes:
    from prometheus_client import generate_latest

    return generate_latest(ctx.metrics.registry)
