"""Which bytes go where: NIXL READ descriptor pairs for a set of blocks (pure numpy).

A block of one layer on one rank holds K (then, ``capacity`` blocks later, V) as
``block_size x heads x head_size`` in NHD or ``heads x block_size x head_size`` in HND.
A decode rank reads, from one prefill rank, the KV heads both hold (heterogeneous TP: a
head slice), and converts the layout on the way when the two differ. The unit is one
(token, head) row of ``head_size`` elements, contiguous in both layouts; rows contiguous
on both sides are merged.

Fewer, larger descriptors: NIXL's cost is mostly per descriptor (``kvferry bench
transfer``: 0.8 GB/s with 4 KB descriptors, 3.9 GB/s with 64 KB), so a request's block
pairs are first cut into *runs* (`block_runs`): pairs ``(l + i, r + i)`` for ``i < n``.
The pairs are sorted first: a READ's descriptors are unordered, and the block pool
returns a freed request's blocks last-first, so on a busy server a request's ids mostly
descend on both sides. When a block pair exchanges whole blocks (equal layouts, equal
head sets: the common case), each run of each region is ONE descriptor of ``n`` blocks;
otherwise (head slices, layout conversion) a block's bytes are not contiguous with its
neighbour's and each block of a run keeps its own rows.

Descriptors are built per READ and handed to ``initialize_xfer`` (agent.py), not taken
from lists prepared at registration (``prep_xfer_dlist`` / ``make_prepped_xfer``): a
prepared list fixes the granularity (one entry per block), so runs of any length would
need a list per length. Building a few dozen descriptors per request is cheap.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvferry.connector.nixl.protocol import LayerRegion
from kvferry.kv.spec import Layout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankView:
    """One rank's KV cache as the planner needs it."""

    layout: Layout
    heads: int  # KV heads this rank holds
    head_start: int  # global index of its first head
    block_size: int
    head_size: int
    itemsize: int
    layers: dict[str, LayerRegion]
    device_id: int = 0

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.heads * self.head_size * self.itemsize

    def row_offsets(self, tokens: np.ndarray, heads: np.ndarray) -> np.ndarray:
        """Byte offsets in a block of the (token, global head) rows."""
        local = heads - self.head_start
        if self.layout is Layout.NHD:
            rows = tokens * self.heads + local
        else:
            rows = local * self.block_size + tokens
        offsets: np.ndarray = rows * (self.head_size * self.itemsize)
        return offsets


@dataclass
class ReadPlan:
    local: np.ndarray  # [n, 3] uint64: address, length, device id
    remote: np.ndarray  # [n, 3]

    @property
    def num_descriptors(self) -> int:
        return len(self.local)

    @property
    def num_bytes(self) -> int:
        return int(self.local[:, 1].sum()) if len(self.local) else 0


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return max(a[0], b[0]) < min(a[0] + a[1], b[0] + b[1])


def shared_heads(a: RankView, b: RankView) -> tuple[int, int]:
    """The global KV head range both ranks hold (empty when lo >= hi)."""
    return max(a.head_start, b.head_start), min(a.head_start + a.heads, b.head_start + b.heads)


def _merge(loc: np.ndarray, rem: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, ...]:
    """Merge consecutive rows contiguous on both sides."""
    if len(loc) == 0:
        return loc, rem, length
    ends_l = loc[:-1] + length[:-1]
    ends_r = rem[:-1] + length[:-1]
    starts = np.concatenate(([True], (loc[1:] != ends_l) | (rem[1:] != ends_r)))
    idx = np.flatnonzero(starts)
    return loc[idx], rem[idx], np.add.reduceat(length, idx)


def block_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> np.ndarray:
    """Block pairs ``(local_ids[i], remote_ids[i])`` as runs: int64 ``[n, 3]`` rows of (first
    local id, first remote id, count), each run pairing ``l + k`` with ``r + k``, k < count.

    Order-free (sorted by remote id): ``[9, 8, 7] <- [5, 4, 3]`` is one run ``(7, 3, 3)``.
    """
    local = np.asarray(local_ids, dtype=np.int64)
    remote = np.asarray(remote_ids, dtype=np.int64)
    assert local.shape == remote.shape and local.ndim == 1
    if not len(local):
        return np.zeros((0, 3), dtype=np.int64)
    order = np.argsort(remote, kind="stable")
    local, remote = local[order], remote[order]
    breaks = np.flatnonzero((np.diff(local) != 1) | (np.diff(remote) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [len(local)])))
    return np.stack([local[starts], remote[starts], counts], axis=1)


def _block_template(local: RankView, remote: RankView) -> tuple[np.ndarray, ...]:
    """Offsets (local, remote) and lengths of the rows one block pair exchanges."""
    lo, hi = shared_heads(local, remote)
    heads = np.arange(lo, hi, dtype=np.int64)
    tokens = np.arange(local.block_size, dtype=np.int64)
    if local.layout is Layout.HND:  # follow the local order: its runs stay contiguous
        grid_h, grid_t = np.meshgrid(heads, tokens, indexing="ij")
    else:
        grid_t, grid_h = np.meshgrid(tokens, heads, indexing="ij")
    h, t = grid_h.ravel(), grid_t.ravel()
    row = np.full(len(h), local.head_size * local.itemsize, dtype=np.int64)
    return _merge(local.row_offsets(t, h), remote.row_offsets(t, h), row)


def plan_read(
    local: RankView,
    remote: RankView,
    layer_names: Sequence[str],
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
) -> ReadPlan:
    """Descriptors reading `remote` blocks into `local` blocks of one KV cache group.

    The block ids pair up; both ranks must agree on block size, head size and item size.
    """
    assert local.block_size == remote.block_size and local.head_size == remote.head_size
    assert local.itemsize == remote.itemsize and len(local_ids) == len(remote_ids)
    lo, hi = shared_heads(local, remote)
    if lo >= hi or not local_ids or not layer_names:
        return empty_plan()
    l_off, r_off, length = _run_rows(local, remote, block_runs(local_ids, remote_ids))
    locs, rems, lens = [], [], []
    seen: set[tuple[int, int]] = set()
    for name in layer_names:
        lreg, rreg = local.layers[name], remote.layers[name]
        if (lreg.base, rreg.base) in seen:
            continue  # layers sharing a tensor (KV sharing) share its blocks: read them once
        seen.add((lreg.base, rreg.base))
        for kv in (0, 1):
            locs.append(lreg.base + kv * lreg.capacity * local.block_bytes + l_off)
            rems.append(rreg.base + kv * rreg.capacity * remote.block_bytes + r_off)
            lens.append(length)
    loc, rem, length = _merge(np.concatenate(locs), np.concatenate(rems), np.concatenate(lens))
    return ReadPlan(_descs(loc, length, local.device_id), _descs(rem, length, remote.device_id))


def _run_rows(local: RankView, remote: RankView, runs: np.ndarray) -> tuple[np.ndarray, ...]:
    """Offsets from a region's start (local, remote) and lengths of the rows runs exchange."""
    t_loc, t_rem, t_len = _block_template(local, remote)
    first_l, first_r, count = runs[:, 0], runs[:, 1], runs[:, 2]
    if len(t_len) == 1 and t_len[0] == local.block_bytes == remote.block_bytes:
        return first_l * local.block_bytes, first_r * remote.block_bytes, count * local.block_bytes
    # Parts of blocks: each block of a run keeps its own rows.
    step = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    lb, rb = np.repeat(first_l, count) + step, np.repeat(first_r, count) + step
    l_off = (lb[:, None] * local.block_bytes + t_loc[None, :]).ravel()
    r_off = (rb[:, None] * remote.block_bytes + t_rem[None, :]).ravel()
    return l_off, r_off, np.broadcast_to(t_len, (len(lb), len(t_len))).ravel()


def empty_plan() -> ReadPlan:
    return ReadPlan(np.zeros((0, 3), dtype=np.uint64), np.zeros((0, 3), dtype=np.uint64))


def concat(plans: Sequence[ReadPlan]) -> ReadPlan:
    plans = [p for p in plans if p.num_descriptors]
    if not plans:
        return empty_plan()
    return ReadPlan(np.concatenate([p.local for p in plans]), np.concatenate([p.remote for p in plans]))


def _descs(addr: np.ndarray, length: np.ndarray, device_id: int) -> np.ndarray:
    out = np.empty((len(addr), 3), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = length
    out[:, 2] = device_id
    return out
