"""NIXL read planning (no NIXL): head slices, layout conversion, descriptor merging.

Each plan is executed with memmove on real tensors and the result compared with the
reference KV: a prefill rank's blocks land in a decode rank's blocks, converted.
"""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from kvferry.connector.nixl.plan import RankView, block_runs, concat, plan_read
from kvferry.connector.nixl.protocol import LayerRegion
from kvferry.kv.spec import Layout
from kvferry.model.layers.parallel import kv_head_range

BS, HEADS, DIM, BLOCKS, LAYERS = 4, 4, 8, 10, 2


def _tensor(layout: Layout, heads: int) -> torch.Tensor:
    return torch.zeros(layout.shape(BLOCKS, BS, heads, DIM), dtype=torch.float32)


def _heads(tp: int, rank: int) -> slice:
    start, count = kv_head_range(rank, tp, HEADS)
    return slice(start, start + count)


def _count(tp: int, rank: int) -> int:
    return kv_head_range(rank, tp, HEADS)[1]


def _view(layout: Layout, tp: int, rank: int, tensors: list[torch.Tensor]) -> RankView:
    h = _heads(tp, rank)
    layers = {f"l{i}": LayerRegion(f"l{i}", t.data_ptr(), BLOCKS) for i, t in enumerate(tensors)}
    return RankView(layout, h.stop - h.start, h.start, BS, DIM, 4, layers)


def _put(tensor: torch.Tensor, layout: Layout, block: int, kv_block: torch.Tensor) -> None:
    """kv_block: [2, BS, heads, DIM] (NHD semantics) into the tensor's block."""
    tensor[:, block] = kv_block if layout is Layout.NHD else kv_block.transpose(1, 2)


def _get(tensor: torch.Tensor, layout: Layout, block: int) -> torch.Tensor:
    out = tensor[:, block]
    return out if layout is Layout.NHD else out.transpose(1, 2)


def _run(plan) -> None:
    for (dst, n, _), (src, m, _) in zip(plan.local.tolist(), plan.remote.tolist()):
        assert n == m
        ctypes.memmove(dst, src, n)


TPS = [(1, 1), (1, 2), (2, 1), (2, 4), (3, 1), (1, 3), (8, 2), (2, 8)]  # uneven (3), replicated (8)
CASES = list(itertools.product([Layout.NHD, Layout.HND], [Layout.NHD, Layout.HND], TPS))


BLOCK_IDS = {
    "scattered": ([7, 2, 5], [1, 8, 3]),
    # reversed runs, gaps and a prefix-cache offset: the prefiller holds the prompt in blocks
    # [9, 8, 7, 6, 5, 0, 1], the decoder already has the first two and reads from block 2 on
    "runs": ([7, 6, 5, 0, 1], [4, 3, 2, 8, 9]),
}


@pytest.mark.parametrize("block_ids", BLOCK_IDS.values(), ids=BLOCK_IDS.keys())
@pytest.mark.parametrize(("remote_layout", "local_layout", "tps"), CASES)
def test_plan_moves_the_right_heads_in_the_right_layout(remote_layout, local_layout, tps, block_ids):
    remote_tp, local_tp = tps
    remote_ids, local_ids = block_ids
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(LAYERS, len(local_ids), 2, BS, HEADS, DIM, generator=gen)
    remote = {
        p: [_tensor(remote_layout, _count(remote_tp, p)) for _ in range(LAYERS)] for p in range(remote_tp)
    }
    for p, tensors in remote.items():
        h = _heads(remote_tp, p)
        for layer, tensor in enumerate(tensors):
            for i, rb in enumerate(remote_ids):
                _put(tensor, remote_layout, rb, full[layer, i, :, :, h])
    names = [f"l{i}" for i in range(LAYERS)]
    for d in range(local_tp):
        local = [_tensor(local_layout, _count(local_tp, d)) for _ in range(LAYERS)]
        lview = _view(local_layout, local_tp, d, local)
        plans = [
            plan_read(lview, _view(remote_layout, remote_tp, p, remote[p]), names, local_ids, remote_ids)
            for p in range(remote_tp)
        ]
        _run(concat(plans))
        h = _heads(local_tp, d)
        for layer in range(LAYERS):
            for i, lb in enumerate(local_ids):
                assert torch.equal(_get(local[layer], local_layout, lb), full[layer, i, :, :, h])
            untouched = [b for b in range(BLOCKS) if b not in local_ids]
            assert not local[layer][:, untouched].any()


@pytest.mark.parametrize(
    ("layout", "local_ids", "remote_ids"),
    [
        (Layout.NHD, [3, 4, 5, 9], [0, 1, 2, 6]),  # ascending: (3,4,5)<-(0,1,2) and 9<-6
        (Layout.HND, [6, 5, 4, 1], [9, 8, 7, 2]),  # reversed: (4,5,6)<-(7,8,9) and 1<-2
    ],
)
def test_equal_layouts_read_whole_block_runs(layout, local_ids, remote_ids):
    remote = [_tensor(layout, HEADS) for _ in range(LAYERS)]
    local = [_tensor(layout, HEADS) for _ in range(LAYERS)]
    names = [f"l{i}" for i in range(LAYERS)]
    plan = plan_read(_view(layout, 1, 0, local), _view(layout, 1, 0, remote), names, local_ids, remote_ids)
    # one descriptor per run, for K and V of each layer
    assert plan.num_descriptors == LAYERS * 2 * 2
    block = BS * HEADS * DIM * 4
    assert sorted(plan.local[:, 1].tolist()) == [block] * (LAYERS * 2) + [3 * block] * (LAYERS * 2)


def test_a_plan_over_no_layers_reads_nothing():
    """Layer-wise loads plan per batch of layers; a group none of whose layers is in the
    batch (a sliding group while full layers arrive) reads nothing, and fails nothing."""
    remote = [_tensor(Layout.NHD, HEADS) for _ in range(LAYERS)]
    local = [_tensor(Layout.NHD, HEADS) for _ in range(LAYERS)]
    plan = plan_read(_view(Layout.NHD, 1, 0, local), _view(Layout.NHD, 1, 0, remote), [], [3, 4], [0, 1])
    assert plan.num_descriptors == 0 and plan.num_bytes == 0


def test_mixed_layouts_fall_back_to_rows():
    remote = [_tensor(Layout.NHD, HEADS)]
    local = [_tensor(Layout.HND, HEADS)]
    plan = plan_read(_view(Layout.HND, 1, 0, local), _view(Layout.NHD, 1, 0, remote), ["l0"], [1], [1])
    assert plan.num_descriptors == 2 * BS * HEADS  # one row per (token, head), K and V
    assert (
        plan_read(
            _view(Layout.HND, 1, 0, local), _view(Layout.NHD, 1, 0, remote), ["l0"], [], []
        ).num_descriptors
        == 0
    )


@pytest.mark.parametrize(
    ("local_ids", "remote_ids", "runs"),
    [
        ([3, 4, 5], [0, 1, 2], [(3, 0, 3)]),  # contiguous on both sides
        ([7], [2], [(7, 2, 1)]),  # a single block
        ([], [], []),
        ([9, 8, 7], [5, 4, 3], [(7, 3, 3)]),  # reversed (freed blocks come back last-first)
        ([3, 4, 6, 7], [0, 1, 2, 3], [(3, 0, 2), (6, 2, 2)]),  # a gap on the local side
        ([3, 4, 5, 6], [0, 1, 5, 6], [(3, 0, 2), (5, 5, 2)]),  # a gap on the remote side
        ([1, 2, 3], [6, 5, 4], [(3, 4, 1), (2, 5, 1), (1, 6, 1)]),  # opposite directions: no run
        ([12, 13, 20], [2, 3, 4], [(12, 2, 2), (20, 4, 1)]),  # prefix-cache hit: a read from block 2 on
        ([5, 6, 1, 2], [10, 11, 0, 1], [(1, 0, 2), (5, 10, 2)]),  # runs in any order
    ],
)
def test_block_runs(local_ids, remote_ids, runs):
    assert [tuple(r) for r in block_runs(local_ids, remote_ids).tolist()] == runs
