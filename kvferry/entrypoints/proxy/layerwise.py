"""Layer-wise legs: the prefill and the decode request go out together.

A prefill instance whose connector streams its prefills (NixlConnector with
``"layerwise": true``) says how decoders reach it at ``GET /v1/kv_transfer/source``. For
such an instance the proxy names the leg's transfer (a fresh ``transfer_id``) and, instead
of waiting for the prefill's answer, hands the decoder at once the params that point to it
(``remote_transfer_id``): the decoder reads each layer's KV as the prefiller's forward
finishes it, and its acknowledgement carries the prefiller's first token, which the
decoder outputs as its own. The prefill's own answer comes in the background: a streamed
answer sends its token to the client early if it comes before the decoder's stream opens
(streaming.py), and a leg nobody decodes releases the prefill's KV once that answer names
it (pd.py); a prefill that fails leaves the decoder to its load-failure policy
(recompute: it computes the prompt itself).

Whole-request transfer stays for everything else: an instance that does not stream, and a
leg that asks for prompt_logprobs (only the prefiller computes them).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING, Any

import httpx

from kvferry.entrypoints.proxy.pool import Instance

if TYPE_CHECKING:
    from kvferry.entrypoints.proxy.pd import ProxyContext

logger = logging.getLogger(__name__)

SOURCE_PATH = "/v1/kv_transfer/source"
SOURCE_TIMEOUT_S = 5.0
SOURCE_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_tp_size")


def can_stream(body: dict[str, Any]) -> bool:
    """Whether a leg may take the layer-wise path (prompt_logprobs come from the prefill's answer)."""
    return body.get("prompt_logprobs") is None


async def stream_source(ctx: ProxyContext, inst: Instance, headers: dict[str, str]) -> dict[str, Any] | None:
    """The instance's layer-wise source (None: it does not stream), asked once per run."""
    if inst.stream_source_asked and inst.stream_source_run == inst.instance_id:
        return inst.stream_source
    try:
        resp = await ctx.upstream.client.get(
            inst.url + SOURCE_PATH, headers=headers, timeout=SOURCE_TIMEOUT_S
        )
        answer = resp.json() if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError) as exc:
        logger.info("%s: no layer-wise source (%s)", inst.url, exc)
        return None  # asked again next time
    source = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(source, dict) or not all(key in source for key in SOURCE_KEYS):
        source = None
    inst.stream_source, inst.stream_source_run = source, inst.instance_id
    inst.stream_source_asked = True
    return source


async def start_streamed_prefill(
    ctx: ProxyContext, inst: Instance, path: str, prefill: dict[str, Any], headers: dict[str, str]
) -> tuple[dict[str, Any], asyncio.Future[dict[str, Any] | None]] | None:
    """Send the leg's prefill (``prefill``: its body) to ``inst`` (acquired by the caller) if
    it streams, and return, without waiting for its answer, the params that point a decoder
    to it and the answer to come (``inst`` is released once it came; None if the prefill
    failed); None if the instance does not stream."""
    try:
        source = await stream_source(ctx, inst, headers)
    except BaseException:
        ctx.prefill.release(inst)
        raise
    if source is None:
        return None
    transfer_id = uuid.uuid4().hex
    prefill = {**prefill, "kv_transfer_params": {**prefill["kv_transfer_params"], "transfer_id": transfer_id}}
    answer = ctx.spawn(_prefill(ctx, inst, path, prefill, headers))
    return {**source, "do_remote_prefill": True, "remote_transfer_id": transfer_id}, answer


async def _prefill(
    ctx: ProxyContext, inst: Instance, path: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any] | None:
    """The streamed prefill's own request, on the instance its params name (no other will do)."""
    try:
        return await ctx.upstream.post_pinned(ctx.prefill, inst, path, body, headers)
    except Exception as exc:  # the decoder's load fails in turn: its policy answers
        logger.warning("streamed prefill on %s failed: %s", inst.url, exc)
        return None
