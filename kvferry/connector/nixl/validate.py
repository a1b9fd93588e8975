"""Decode side: does a request's remote prefill check out against the remote's handshake?"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from kvferry.connector.nixl.params import RemotePrefill
from kvferry.connector.nixl.protocol import EngineInfo, GroupInfo, GroupKind
from kvferry.kv.null_block import null_block_id
from kvferry.kv.window import first_visible_block

logger = logging.getLogger(__name__)


class LocalEngine(Protocol):
    compat: str
    block_size: int
    groups: list[GroupInfo]


def null_block(groups: Sequence[GroupInfo]) -> int:
    """The id of the placeholder block of an engine with these groups (sliding windows reserve 0)."""
    return null_block_id(any(g.kind is GroupKind.SLIDING for g in groups))


def _engine_mismatch(remote: RemotePrefill, info: EngineInfo, local: LocalEngine) -> str | None:
    where = f"{remote.host}:{remote.port}"
    if info.engine_id != remote.engine_id:
        return f"remote_engine_id {remote.engine_id!r} is not the engine at {where} ({info.engine_id!r})"
    if info.compat_hash != local.compat:
        difference = group_difference(info.groups, local.groups) or (
            f"model, dtype, KV heads, head size or layers differ: {info.compat_hash} != {local.compat}"
        )
        return f"the engine at {where} serves an incompatible model or KV cache ({difference})"
    if info.block_size != local.block_size:
        return (
            f"the engine at {where} uses KV blocks of {info.block_size} tokens, this one {local.block_size}"
        )
    if info.tp_size != remote.tp_size or len(info.ranks) != info.tp_size:
        return f"remote_tp_size is {remote.tp_size}, the engine at {where} runs {info.tp_size} ranks"
    return None


def group_difference(remote: Sequence[GroupInfo], local: Sequence[GroupInfo]) -> str | None:
    """The first way the remote engine's KV cache groups differ from this one's, in words
    (KV heads per rank are left out: tensor-parallel sizes may differ); None if they agree."""
    if len(remote) != len(local):
        return f"{len(remote)} KV cache groups there, {len(local)} here ({_kinds(remote)} vs {_kinds(local)})"
    for gid, (there, here) in enumerate(zip(remote, local, strict=True)):
        for what, a, b in (
            ("kind", there.kind, here.kind),
            ("sliding window", there.sliding_window, here.sliding_window),
            ("stored head size", there.head_size, here.head_size),
            ("dtype", there.dtype, here.dtype),
            ("layers", there.layer_names, here.layer_names),
        ):
            if a != b:
                return f"KV cache group {gid}: {what} {a} there, {b} here"
    return None


def _kinds(groups: Sequence[GroupInfo]) -> str:
    return ", ".join(
        f"window {g.sliding_window}" if g.kind is GroupKind.SLIDING else str(g.kind) for g in groups
    )


def check_remote(
    remote: RemotePrefill, info: EngineInfo, local: LocalEngine, num_prompt_tokens: int
) -> str | None:
    """Why the params do not match the remote engine (a client error), or None."""
    problem = _engine_mismatch(remote, info, local)
    if problem is not None:
        return f"kv_transfer_params: {problem}"
    if remote.num_tokens > num_prompt_tokens:
        return (
            f"kv_transfer_params: remote_num_tokens ({remote.num_tokens}) exceeds the prompt "
            f"({num_prompt_tokens} tokens)"
        )
    if len(remote.block_ids) != len(info.groups):
        return f"kv_transfer_params: remote_block_ids has {len(remote.block_ids)} groups, the engine {len(info.groups)}"
    needed = -(-remote.num_tokens // info.block_size)
    null = null_block(info.groups)
    for gid, ids in enumerate(remote.block_ids):
        if len(ids) != needed:
            return (
                f"kv_transfer_params: remote_block_ids[{gid}] has {len(ids)} blocks; "
                f"{remote.num_tokens} tokens take {needed}"
            )
        bad = [b for b in ids if b >= info.num_blocks]
        if bad:
            return f"kv_transfer_params: remote block ids {bad[:4]} are out of range [0, {info.num_blocks})"
        first = _first_needed(info.groups[gid], remote.num_tokens)
        if null in ids[first:]:
            return (
                f"kv_transfer_params: remote_block_ids[{gid}] has the placeholder block {null} "
                f"among the blocks from {first} on, whose KV a decoder reads"
            )
    return None


def _first_needed(group: GroupInfo, num_tokens: int) -> int:
    """The first of a prefill's blocks in this group a decoder may read: every block of a
    full group; of a sliding group, those the last prompt token's window sees."""
    if group.kind is GroupKind.SLIDING and group.sliding_window:
        return first_visible_block(group.sliding_window, group.block_size, num_tokens - 1)
    return 0


def blocks_to_read(
    groups: Sequence[GroupInfo],
    local_ids: Sequence[Sequence[int]],
    remote_ids: Sequence[Sequence[int]],
    start: int,
    end: int,
    remote_null: int,
) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Per group, the (local, remote) block ids holding tokens [start, end) to read.

    A sliding-window group reads only the blocks the token at `end` (the first the decoder
    computes) sees, which the prefiller always holds (`kvferry.kv.window`); the decoder
    lets go of its earlier blocks unfilled when the load completes. Pairs with a placeholder
    block on either side are skipped (nothing there to read or keep).
    """
    local_null = null_block(groups)
    out = []
    for group, lids, rids in zip(groups, local_ids, remote_ids, strict=True):
        first, last = start // group.block_size, -(-end // group.block_size)
        if group.kind is GroupKind.SLIDING and group.sliding_window:
            first = max(first, first_visible_block(group.sliding_window, group.block_size, end))
        pairs = [
            (lb, rb)
            for lb, rb in zip(lids[first:last], rids[first:last], strict=True)
            if lb != local_null and rb != remote_null
        ]
        out.append((tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)))
    return tuple(out)
