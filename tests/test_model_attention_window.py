"""PagedAttention with a sliding window against plain windowed attention: decodes, fresh and
chunked prefills, both layouts; blocks the window no longer sees hold garbage (as they do
once a sliding-window group has freed them)."""

from __future__ import annotations

import pytest
import torch

from kvferry.kv.spec import Layout
from kvferry.model.forward_context import AttentionMetadata, ForwardContext, PrefillSpan
from kvferry.model.layers.attention import PagedAttention, write_kv

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
LAYER = "model.layers.0.self_attn.attn"
GARBAGE_BLOCK = 0  # what freed blocks point at: finite values nobody may read


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """The last q.shape[0] positions of a sequence, each seeing its last `window` positions."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    total, lq = k.shape[0], q.shape[0]
    diff = (torch.arange(lq).unsqueeze(1) + total - lq) - torch.arange(total).unsqueeze(0)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill((diff < 0) | (diff >= window), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _case(layout: Layout, seqs: list[tuple[int, int]], block_size: int, window: int, trim: bool = False):
    """seqs: (context_len, query_len); query_len 1 with context is a decode. `trim`: decode
    tables start at the first block the window sees (as the runner builds them)."""
    gen = torch.Generator().manual_seed(3)
    free = torch.randperm(95, generator=gen).add(1).tolist()  # block 0: the garbage block
    cache = torch.randn(layout.shape(96, block_size, KV_HEADS, HEAD_DIM), generator=gen) * 5
    layer = PagedAttention(LAYER, HEADS, KV_HEADS, HEAD_DIM, scale=HEAD_DIM**-0.5, sliding_window=window)
    order = sorted(range(len(seqs)), key=lambda i: not (seqs[i][1] == 1 and seqs[i][0] > 0))
    qs, ks, vs, slots, spans, tables, lens, refs, starts = [], [], [], [], [], [], [], [], []
    for i in order:
        ctx_len, q_len = seqs[i]
        total = ctx_len + q_len
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        seq_slots = torch.tensor(
            [blocks[p // block_size] * block_size + p % block_size for p in range(total)]
        )
        q, k, v = (torch.randn(total, h, HEAD_DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
        write_kv(cache, layout, k[:ctx_len], v[:ctx_len], seq_slots[:ctx_len])
        refs.append(reference(q[ctx_len:], k, v, layer.scale, window))
        seen_from = max(0, ctx_len - window + 1) // block_size  # blocks before it: freed
        blocks = [GARBAGE_BLOCK] * seen_from + blocks[seen_from:]
        if q_len == 1 and ctx_len:
            first = max(0, total - window) // block_size if trim else 0
            tables.append(blocks[first:])
            lens.append(total)
            starts.append(first * block_size)
        else:
            spans.append(PrefillSpan(sum(len(x) for x in qs), q_len, ctx_len, torch.tensor(blocks)))
        for out, src in ((qs, q), (ks, k), (vs, v)):
            out.append(src[ctx_len:])
        slots.append(seq_slots[ctx_len:])
    width = max((len(t) for t in tables), default=0)
    attn = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decodes=len(tables),
        decode_block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]).view(
            len(tables), width
        ),
        decode_seq_lens=torch.tensor(lens, dtype=torch.int64),
        prefills=spans,
        block_size=block_size,
        decode_start_pos=torch.tensor(starts, dtype=torch.int64) if trim else None,
    )
    ctx = ForwardContext(attn=(attn,), layer_group={LAYER: 0}, kv_caches={LAYER: cache}, layout=layout)
    return layer, torch.cat(qs), torch.cat(ks), torch.cat(vs), ctx, torch.cat(refs)


MIXES = {
    "decodes": [(5, 1), (17, 1), (1, 1), (40, 1)],
    "fresh": [(0, 7), (0, 1), (0, 23)],
    "same_length": [(0, 12), (0, 12), (0, 12)],
    "chunked": [(9, 6), (16, 16), (30, 3), (3, 20)],
    "mixed": [(12, 1), (0, 11), (33, 1), (27, 9), (0, 3)],
}


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize(("block_size", "window"), [(4, 6), (4, 8), (16, 5)])
@pytest.mark.parametrize("trim", [False, True])
def test_windowed_paged_matches_reference(
    layout: Layout, mix: str, block_size: int, window: int, trim: bool
) -> None:
    layer, q, k, v, ctx, ref = _case(layout, MIXES[mix], block_size, window, trim)
    out = layer(q.flatten(1), k.flatten(1), v.flatten(1), ctx)
    torch.testing.assert_close(out.view_as(q).double(), ref, atol=1e-5, rtol=1e-5)


def test_an_ignored_window_would_fail() -> None:
    layer, q, k, v, ctx, ref = _case(Layout.NHD, MIXES["mixed"], 4, 6)
    layer.sliding_window = None
    out = layer(q.flatten(1), k.flatten(1), v.flatten(1), ctx)
    assert not torch.allclose(out.view_as(q).double(), ref, atol=1e-3)
