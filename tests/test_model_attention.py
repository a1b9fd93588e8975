"""PagedAttention against plain causal attention: shuffled blocks, both layouts, mixed batches."""

from __future__ import annotations

import pytest
import torch

from kvferry.kv.spec import Layout
from kvferry.model.forward_context import (
    AttentionMetadata,
    ForwardContext,
    HookPlacement,
    PrefillSpan,
    Workspace,
)
from kvferry.model.layers import attention
from kvferry.model.layers.attention import PagedAttention, gather_kv, write_kv

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
LAYER = "model.layers.0.self_attn.attn"


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Unpaged causal attention of the last q.shape[0] positions of a k/v sequence (float64)."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    total, lq = k.shape[0], q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    query_pos = torch.arange(lq).unsqueeze(1) + (total - lq)
    scores = scores.masked_fill(torch.arange(total).unsqueeze(0) > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _case(
    seed: int,
    layout: Layout,
    seqs: list[tuple[int, int, bool]],
    block_size: int,
    num_blocks: int = 96,
    workspace: Workspace | None = None,
):
    """seqs: (context_len, query_len, is_decode). Returns (layer, q, k, v, ctx, references)."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    shape = layout.shape(num_blocks, block_size, KV_HEADS, HEAD_DIM)
    cache = torch.randn(shape, generator=gen) * 5  # finite garbage outside the live slots
    layer = PagedAttention(
        LAYER,
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        scale=HEAD_DIM**-0.5,
    )
    order = sorted(range(len(seqs)), key=lambda i: not seqs[i][2])
    qs, ks, vs, slots, spans, tables, lens, refs = [], [], [], [], [], [], [], []
    for i in order:
        ctx_len, q_len, is_decode = seqs[i]
        total = ctx_len + q_len
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        seq_slots = torch.tensor(
            [blocks[p // block_size] * block_size + p % block_size for p in range(total)]
        )
        q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
        k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
        write_kv(cache, layout, k[:ctx_len], v[:ctx_len], seq_slots[:ctx_len])
        refs.append(reference(q[ctx_len:], k, v, layer.scale))
        if is_decode:
            tables.append(blocks)
            lens.append(total)
        else:
            spans.append(PrefillSpan(sum(len(x) for x in qs), q_len, ctx_len, torch.tensor(blocks)))
        qs.append(q[ctx_len:])
        ks.append(k[ctx_len:])
        vs.append(v[ctx_len:])
        slots.append(seq_slots[ctx_len:])
    width = max((len(t) for t in tables), default=0)
    attn = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decodes=len(tables),
        decode_block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64).view(
            len(tables), width
        ),
        decode_seq_lens=torch.tensor(lens, dtype=torch.int64),
        prefills=spans,
        block_size=block_size,
    )
    ctx = ForwardContext(
        attn=(attn,), layer_group={LAYER: 0}, kv_caches={LAYER: cache}, layout=layout, workspace=workspace
    )
    return layer, torch.cat(qs), torch.cat(ks), torch.cat(vs), ctx, torch.cat(refs)


MIXES = {
    "decodes": [(5, 1, True), (17, 1, True), (1, 1, True), (32, 1, True)],
    "prefills": [(0, 7, False), (0, 1, False), (0, 20, False)],
    "chunked": [(9, 6, False), (16, 16, False), (3, 1, False)],
    "mixed": [(12, 1, True), (0, 11, False), (30, 1, True), (7, 9, False), (0, 3, False), (4, 1, True)],
    # runs of equal-length fresh prompts go through one batched call; others break the runs
    "same_length": [(0, 6, False), (0, 6, False), (0, 6, False), (2, 6, False), (0, 6, False), (0, 6, False)],
    "same_length_mixed": [
        (3, 1, True),
        (0, 5, False),
        (0, 5, False),
        (0, 4, False),
        (0, 4, False),
        (9, 1, True),
    ],
}


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_matches_reference(layout: Layout, mix: str, block_size: int) -> None:
    workspace = Workspace() if block_size == 16 else None
    layer, q, k, v, ctx, ref = _case(7, layout, MIXES[mix], block_size, workspace=workspace)
    out = layer(q.flatten(1), k.flatten(1), v.flatten(1), ctx)
    assert out.shape == (q.shape[0], HEADS * HEAD_DIM)
    torch.testing.assert_close(out.view_as(q).double(), ref, atol=1e-5, rtol=1e-5)


def test_fresh_runs_group_adjacent_equal_spans() -> None:
    from kvferry.model.layers.attention import fresh_runs

    table = torch.zeros(1, dtype=torch.int64)
    spans = [
        PrefillSpan(0, 4, 0, table),
        PrefillSpan(4, 4, 0, table),
        PrefillSpan(8, 4, 2, table),  # cached context: alone
        PrefillSpan(12, 4, 0, table),
        PrefillSpan(16, 3, 0, table),  # another length
        PrefillSpan(19, 3, 0, table),
    ]
    assert [[s.query_start for s in run] for run in fresh_runs(spans)] == [[0, 4], [8], [12], [16, 19]]


def test_workspace_reuses_one_buffer() -> None:
    workspace = Workspace()
    first = workspace.take((2, 8, 4), torch.float32, torch.device("cpu"))
    smaller = workspace.take((3, 5), torch.bfloat16, torch.device("cpu"))
    assert smaller.data_ptr() == first.data_ptr()
    bigger = workspace.take((2, 64, 4), torch.float32, torch.device("cpu"))
    assert bigger.shape == (2, 64, 4)


@pytest.mark.parametrize("layout", list(Layout))
def test_write_then_gather_roundtrip(layout: Layout) -> None:
    layer, q, k, v, ctx, _ = _case(3, layout, [(0, 10, False)], block_size=4)
    layer(q, k, v, ctx)
    span = ctx.attn[0].prefills[0]
    kv = gather_kv(ctx.kv_caches[LAYER], layout, span.block_table)[:, :, :10]
    torch.testing.assert_close(kv[0].transpose(0, 1), k)
    torch.testing.assert_close(kv[1].transpose(0, 1), v)


class RecordingHooks:
    def __init__(self, cache: torch.Tensor, slots: torch.Tensor, layout: Layout, expected: torch.Tensor):
        self.cache, self.slots, self.layout, self.expected = cache, slots, layout, expected
        self.calls: list[tuple[str, str, bool]] = []

    def _written(self) -> bool:
        keys = self.cache[0] if self.layout is Layout.NHD else self.cache[0].transpose(1, 2)
        flat = keys.flatten(0, 1)
        return bool((flat[self.slots] == self.expected).all())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait", layer_name, self._written()))

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor, attn: AttentionMetadata) -> None:
        assert kv_cache is self.cache
        self.calls.append(("save", layer_name, self._written()))


@pytest.mark.parametrize("placement", [HookPlacement.IN_GRAPH, HookPlacement.SPLIT])
@pytest.mark.parametrize("layout", list(Layout))
def test_hooks_wrap_the_cache_write(layout: Layout, placement: HookPlacement) -> None:
    layer, q, k, v, ctx, _ = _case(5, layout, MIXES["mixed"], block_size=4)
    hooks = RecordingHooks(ctx.kv_caches[LAYER], ctx.attn[0].slot_mapping, layout, k)
    ctx.kv_hooks = hooks
    layer.hooks = placement
    layer(q, k, v, ctx)
    assert hooks.calls == [("wait", LAYER, False), ("save", LAYER, True)]


def test_no_hooks_called_when_the_connector_has_none() -> None:
    layer, q, k, v, ctx, _ = _case(5, Layout.NHD, MIXES["mixed"], block_size=4)
    ctx.kv_hooks = RecordingHooks(ctx.kv_caches[LAYER], ctx.attn[0].slot_mapping, Layout.NHD, k)
    layer(q, k, v, ctx)  # HookPlacement.NONE: the connector declared no per-layer hooks
    assert ctx.kv_hooks.calls == []


def test_bfloat16_close_to_reference() -> None:
    layer, q, k, v, ctx, ref = _case(11, Layout.NHD, MIXES["mixed"], block_size=8)
    ctx.kv_caches[LAYER] = ctx.kv_caches[LAYER].bfloat16()
    ctx.attn[0].prefills = [s for s in ctx.attn[0].prefills if s.context_len == 0]  # context was float32
    out = layer(q.bfloat16(), k.bfloat16(), v.bfloat16(), ctx).view_as(q)
    rows = slice(0, ctx.attn[0].num_decodes)
    assert out.dtype == torch.bfloat16
    assert (out[rows].double() - ref[rows]).abs().max() < 0.05


def test_layers_of_one_step_build_the_decode_mask_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode mask depends on the step, not the layer: the second layer of a step reuses
    the first one's (a second layer sharing the cache here), and both stay correct. (The SDPA
    decode path: the one taken where the CPU decode kernel is not.)"""
    monkeypatch.setattr(attention, "decode_kernel_available", lambda: False)
    layer, q, k, v, ctx, ref = _case(7, Layout.NHD, MIXES["decodes"], 4)
    built = []
    original = attention.Scores.mask
    monkeypatch.setattr(attention.Scores, "mask", lambda self, *a: built.append(1) or original(self, *a))
    shared = PagedAttention("shared", HEADS, KV_HEADS, HEAD_DIM, scale=layer.scale, kv_owner=LAYER)
    first = layer(q.flatten(1), k.flatten(1), v.flatten(1), ctx)
    second = shared(q.flatten(1), k.flatten(1), v.flatten(1), ctx)
    assert len(built) == 1
    torch.testing.assert_close(first.view_as(q).double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second, first)
