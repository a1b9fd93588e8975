"""Paged multi-head latent attention (DeepSeek's MLA) over a latent KV cache.

The cache holds, per token, one row shared by every head: the normalized compressed KV
(`kv_lora_rank` values) then the rotated key part (`qk_rope_head_dim`), stored as one KV
head split over the K and V planes (kvferry.kv.spec.LatentAttentionSpec).

Attention runs with the decompression absorbed into the query and the output (the caller,
kvferry.model.deepseek, does both): each head's query is [q_nope W_uk, q_rope], its keys
are the cached rows themselves and its values their latent part, so every head attends the
same keys (multi-query attention over the rows) and the output is a latent vector per head,
which W_uv turns into the head's values. q.k and the weighted values are those of the
decompressed form (the same products, summed in another order), and nothing per head is
ever materialized for the context: a block's rows are read as they are.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvferry.kv.spec import AttentionLayerKV, Layout, latent_head_size
from kvferry.model import graph_ops
from kvferry.model.forward_context import AttentionMetadata, ForwardContext, PrefillSpan
from kvferry.model.layers.attention import KVCacheLayer, Scores, decode_mask, gather_kv, write_kv
from kvferry.model.operators import operator

logger = logging.getLogger(__name__)


def write_rows(kv_cache: torch.Tensor, layout: Layout, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Store latent rows [T, latent_size] at flat slots: first half in K, second in V."""
    half = latent_head_size(rows.shape[-1])
    rows = F.pad(rows, (0, 2 * half - rows.shape[-1])) if 2 * half != rows.shape[-1] else rows
    write_kv(kv_cache, layout, rows[:, None, :half], rows[:, None, half:], slots)


def gather_rows(
    kv_cache: torch.Tensor, layout: Layout, block_table: torch.Tensor, latent_size: int
) -> torch.Tensor:
    """The latent rows of the blocks in `block_table` [..., n] as [..., n * block_size, latent_size]."""
    half = latent_head_size(latent_size)
    kv = gather_kv(kv_cache, layout, block_table)[..., 0, :, :half]  # [2, ..., L, half]
    return torch.cat((kv[0], kv[1]), dim=-1)[..., :latent_size]


@operator("latent_attention", mutates_args=("out",), tags=(torch.Tag.cudagraph_unsafe,))
def latent_attend(
    q: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    ctx: ForwardContext,
    layer_name: str,
    scale: float,
) -> None:
    """One MLA layer into `out` [T, heads, value_size]: q [T, heads, latent_size] (absorbed
    queries), rows [T, latent_size] (this step's latent rows, written to the cache first).
    Values are the first `value_size` (= out's last dim) values of each row."""
    attn = ctx.attn_for(layer_name)
    kv_cache = ctx.kv_caches[layer_name]
    num_tokens = attn.slot_mapping.numel()  # rows past it pad a captured batch: zeros out
    if q.shape[0] > num_tokens:
        out[num_tokens:].zero_()
        rows = rows[:num_tokens]
    write_rows(kv_cache, ctx.layout, rows, attn.slot_mapping)
    score = Scores(scale)
    decodes = attn.num_decodes
    if decodes:
        out[:decodes] = _decode(q[:decodes], kv_cache, ctx, attn, score, out.shape[-1])
    for span in attn.prefills:
        tokens = slice(span.query_start, span.query_start + span.query_len)
        out[tokens] = _prefill(q[tokens], kv_cache, ctx, span, score, out.shape[-1])


def _decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    ctx: ForwardContext,
    attn: AttentionMetadata,
    score: Scores,
    value_size: int,
) -> torch.Tensor:
    """All decodes in one SDPA call: each request's heads are its queries over its rows."""
    rows = gather_rows(kv_cache, ctx.layout, attn.decode_block_table, q.shape[-1]).to(q.dtype)
    mask = decode_mask(attn, score, rows.shape[1], q.device)  # [B, 1, 1, L]
    keys = rows.unsqueeze(1)  # [B, 1, L, W]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(1), keys, keys[..., :value_size], attn_mask=mask, scale=score.scale
    )
    return out.squeeze(1)  # [B, heads, value_size]


def _prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    ctx: ForwardContext,
    span: PrefillSpan,
    score: Scores,
    value_size: int,
) -> torch.Tensor:
    """One span: causal over the whole sequence so far (its cached context and its own rows,
    all read back from the cache)."""
    total = span.context_len + span.query_len
    block_size = attn_block_size(kv_cache, ctx.layout)
    table = span.block_table[: -(-total // block_size)]
    rows = gather_rows(kv_cache, ctx.layout, table, q.shape[-1])[:total].to(q.dtype)
    heads_first = q.transpose(0, 1).unsqueeze(0)  # [1, heads, Lq, W]
    keys = rows.view(1, 1, total, -1)
    if span.context_len == 0:
        mask = None
    else:
        query_pos = torch.arange(span.context_len, total, device=q.device)
        mask = score.mask(query_pos, torch.arange(total, device=q.device))
    out = F.scaled_dot_product_attention(
        heads_first,
        keys,
        keys[..., :value_size],
        attn_mask=mask,
        is_causal=mask is None,
        scale=score.scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)  # [Lq, heads, value_size]


def attn_block_size(kv_cache: torch.Tensor, layout: Layout) -> int:
    return kv_cache.shape[2] if layout is Layout.NHD else kv_cache.shape[3]


@latent_attend.register_fake
def _(
    q: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor,
    ctx: ForwardContext,
    layer_name: str,
    scale: float,
) -> None:
    return None


class LatentAttention(KVCacheLayer):
    """One MLA layer's paged attention; heads are this rank's heads, the rows every rank's.

    forward(q [T, heads, latent_size], rows [T, latent_size]) -> [T, heads, value_size]:
    absorbed queries in, per-head latent outputs out (`value_size`: the compressed KV's
    width, the part of a row values read)."""

    def __init__(self, layer_name: str, num_heads: int, latent_size: int, value_size: int, scale: float):
        super().__init__(layer_name)
        self.num_heads = num_heads
        self.latent_size = latent_size
        self.value_size = value_size
        self.scale = scale

    def kv_layer(self) -> AttentionLayerKV:
        head_size = latent_head_size(self.latent_size)
        return AttentionLayerKV(self.layer_name, 1, head_size, latent_size=self.latent_size)

    def forward(self, q: torch.Tensor, rows: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        out = q.new_empty(q.shape[0], self.num_heads, self.value_size)
        graph_ops.before_attention(self.hooks, out, ctx, self.layer_name)
        torch.ops.kvferry.latent_attention(q, rows, out, ctx, self.layer_name, self.scale)
        graph_ops.after_attention(self.hooks, out, ctx, self.layer_name)
        return out
