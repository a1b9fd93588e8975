"""Paged multi-head latent attention (DeepSeek's MLA) over a latent KV cache.

The cache holds, per token, one row shared by every head: the normalized compressed KV
(`kv_lora_rank` values, the latent) then the rotated key part (`qk_rope_head_dim`), stored
as one KV head split over the K and V planes (kvferry.kv.spec.LatentAttentionSpec). A head's
key is [latent W_uk, rope part], its value latent W_uv, with W_uk and W_uv its rows of
`kv_b_proj` (the decompression).

Each phase (decodes, prefill spans) runs in one of two forms (kvferry.config.MLAForms):
- absorbed: W_uk folds into each head's query ([q_nope W_uk, q_rope]) and W_uv into its
  output, so every head attends the cached rows themselves (multi-query attention over
  the rows, head size kv_lora_rank + rope) and nothing per head is materialized for the
  context. Per context token and head it costs ~(2 x rank + rope) multiply-adds.
- decompressed: the context's rows are expanded through kv_b_proj into per-head keys and
  values (one GEMM over the context), and attention is ordinary multi-head attention with
  head size nope + rope. Per context token and head it costs ~rank x (nope + value) for the
  expansion, once per step, then ~(nope + rope + value) per query.
Both compute the same products summed in another order. Decode reads its whole context
for one query, so the expansion dominates: absorbed is the faster there; a prefill chunk
shares the expansion over its queries: decompressed is the faster there
(docs/benchmarks.md, "MLA: absorbed or decompressed").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.config import MLAForm, MLAForms
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


@dataclass(frozen=True)
class _Heads:
    """Some tokens' queries on this rank's heads, with the layer's decompression."""

    nope: torch.Tensor  # [T, heads, nope]
    rope: torch.Tensor  # [T, heads, rope], rotated
    kv_b: torch.Tensor  # kv_b_proj's weight [heads * (nope + value), rank]
    value_size: int

    @property
    def rank(self) -> int:
        """kv_lora_rank: the latent part of a row."""
        return self.kv_b.shape[1]

    @property
    def row_width(self) -> int:
        """A cached row: the latent, then the rope key part."""
        return self.rank + self.rope.shape[-1]

    def at(self, tokens: slice) -> _Heads:
        return _Heads(self.nope[tokens], self.rope[tokens], self.kv_b, self.value_size)

    def _per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [heads, nope, rank], W_uv [heads, value, rank])."""
        nope = self.nope.shape[-1]
        per_head = self.kv_b.view(self.nope.shape[1], nope + self.value_size, -1)
        return per_head[:, :nope], per_head[:, nope:]

    def absorbed_queries(self) -> torch.Tensor:
        """[T, heads, rank + rope]: [q_nope W_uk, q_rope]."""
        w_uk, _ = self._per_head()
        q_latent = torch.bmm(self.nope.transpose(0, 1), w_uk).transpose(0, 1)
        return torch.cat((q_latent, self.rope), dim=-1)

    def values_of(self, latent_out: torch.Tensor) -> torch.Tensor:
        """Per-head latent outputs [T, heads, rank] -> values [T, heads, value]."""
        _, w_uv = self._per_head()
        return torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def full_queries(self) -> torch.Tensor:
        """[heads, T, nope + rope]: the decompressed form's queries, heads first."""
        return torch.cat((self.nope, self.rope), dim=-1).transpose(0, 1)

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [..., L, rank + rope] -> keys [..., heads, L, nope + rope] and values
        [..., heads, L, value]: one GEMM through kv_b_proj, the rope part shared by all heads."""
        heads, nope = self.nope.shape[1], self.nope.shape[2]
        rank = self.rank
        kv = F.linear(rows[..., :rank], self.kv_b).view(*rows.shape[:-1], heads, nope + self.value_size)
        k_rope = rows[..., None, rank:].expand(*kv.shape[:-1], rows.shape[-1] - rank)
        keys = torch.cat((kv[..., :nope], k_rope), dim=-1)
        return keys.transpose(-3, -2), kv[..., nope:].transpose(-3, -2)


@operator("latent_attention", mutates_args=("out",), tags=(torch.Tag.cudagraph_unsafe,))
def latent_attend(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    rows: torch.Tensor,
    kv_b: torch.Tensor,
    out: torch.Tensor,
    ctx: ForwardContext,
    layer_name: str,
    scale: float,
    absorbed_decode: bool,
    absorbed_prefill: bool,
) -> None:
    """One MLA layer into `out` [T, heads, value]: q_nope [T, heads, nope] and q_rope
    [T, heads, rope] (rotated) on this rank's heads, rows [T, rank + rope] (this step's
    latent rows, written to the cache first), kv_b kv_b_proj's weight (this rank's heads)."""
    attn = ctx.attn_for(layer_name)
    kv_cache = ctx.kv_caches[layer_name]
    num_tokens = attn.slot_mapping.numel()  # rows past it pad a captured batch: zeros out
    if q_nope.shape[0] > num_tokens:
        out[num_tokens:].zero_()
        rows = rows[:num_tokens]
    write_rows(kv_cache, ctx.layout, rows, attn.slot_mapping)
    heads = _Heads(q_nope, q_rope, kv_b, out.shape[-1])
    score = Scores(scale)
    decodes = attn.num_decodes
    if decodes:
        decode = _decode_absorbed if absorbed_decode else _decode_decompressed
        out[:decodes] = decode(heads.at(slice(0, decodes)), kv_cache, ctx, attn, score)
    prefill = _prefill_absorbed if absorbed_prefill else _prefill_decompressed
    for span in attn.prefills:
        tokens = slice(span.query_start, span.query_start + span.query_len)
        rows = _span_rows(kv_cache, ctx, span, heads.row_width).to(q_nope.dtype)
        out[tokens] = prefill(heads.at(tokens), rows, span, score)


def _decode_absorbed(
    heads: _Heads, kv_cache: torch.Tensor, ctx: ForwardContext, attn: AttentionMetadata, score: Scores
) -> torch.Tensor:
    """All decodes in one SDPA call: each request's heads are its queries over its rows."""
    q = heads.absorbed_queries()  # [B, heads, W]
    rows = gather_rows(kv_cache, ctx.layout, attn.decode_block_table, heads.row_width).to(q.dtype)
    mask = decode_mask(attn, score, rows.shape[1], q.device)  # [B, 1, 1, L]
    keys = rows.unsqueeze(1)  # [B, 1, L, W]
    latent_out = F.scaled_dot_product_attention(
        q.unsqueeze(1), keys, keys[..., : heads.rank], attn_mask=mask, scale=score.scale
    )
    return heads.values_of(latent_out.squeeze(1))  # [B, heads, value]


def _decode_decompressed(
    heads: _Heads, kv_cache: torch.Tensor, ctx: ForwardContext, attn: AttentionMetadata, score: Scores
) -> torch.Tensor:
    """All decodes in one SDPA call over their contexts expanded to per-head keys and values."""
    rows = gather_rows(kv_cache, ctx.layout, attn.decode_block_table, heads.row_width)
    rows = rows.to(heads.nope.dtype)
    mask = decode_mask(attn, score, rows.shape[1], rows.device)  # [B, 1, 1, L]
    keys, values = heads.expand(rows)  # [B, heads, L, *]
    q = heads.full_queries().transpose(0, 1).unsqueeze(2)  # [B, heads, 1, nope + rope]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=score.scale)
    return out.squeeze(2)  # [B, heads, value]


def _span_rows(kv_cache: torch.Tensor, ctx: ForwardContext, span: PrefillSpan, width: int) -> torch.Tensor:
    """[total, rank + rope]: the span's whole sequence so far (cached context, its own rows)."""
    total = span.context_len + span.query_len
    table = span.block_table[: -(-total // attn_block_size(kv_cache, ctx.layout))]
    return gather_rows(kv_cache, ctx.layout, table, width)[:total]


def _span_mask(span: PrefillSpan, score: Scores, device: torch.device) -> torch.Tensor | None:
    """None (plain causal) for a span without cached context, else its queries' mask."""
    if span.context_len == 0:
        return None
    total = span.context_len + span.query_len
    return score.mask(
        torch.arange(span.context_len, total, device=device), torch.arange(total, device=device)
    )


def _prefill_absorbed(heads: _Heads, rows: torch.Tensor, span: PrefillSpan, score: Scores) -> torch.Tensor:
    """One span, causal over its rows: its heads' absorbed queries over the rows (MQA)."""
    q = heads.absorbed_queries()
    keys = rows.view(1, 1, rows.shape[0], -1)
    mask = _span_mask(span, score, q.device)
    latent_out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, heads, Lq, W]
        keys,
        keys[..., : heads.rank],
        attn_mask=mask,
        is_causal=mask is None,
        scale=score.scale,
        enable_gqa=True,
    )
    return heads.values_of(latent_out.squeeze(0).transpose(0, 1))  # [Lq, heads, value]


def _prefill_decompressed(
    heads: _Heads, rows: torch.Tensor, span: PrefillSpan, score: Scores
) -> torch.Tensor:
    """One span, causal over its rows expanded to per-head keys and values (MHA)."""
    keys, values = heads.expand(rows)  # [heads, total, *]
    mask = _span_mask(span, score, rows.device)
    out = F.scaled_dot_product_attention(
        heads.full_queries(), keys, values, attn_mask=mask, is_causal=mask is None, scale=score.scale
    )
    return out.transpose(0, 1)  # [Lq, heads, value]


def attn_block_size(kv_cache: torch.Tensor, layout: Layout) -> int:
    return kv_cache.shape[2] if layout is Layout.NHD else kv_cache.shape[3]


@latent_attend.register_fake
def _(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    rows: torch.Tensor,
    kv_b: torch.Tensor,
    out: torch.Tensor,
    ctx: ForwardContext,
    layer_name: str,
    scale: float,
    absorbed_decode: bool,
    absorbed_prefill: bool,
) -> None:
    return None


class LatentAttention(KVCacheLayer):
    """One MLA layer's paged attention; heads are this rank's heads, the rows every rank's.

    forward(q_nope [T, heads, nope], q_rope [T, heads, rope] (rotated), rows [T, latent_size],
    kv_b (kv_b_proj's weight, this rank's heads)) -> [T, heads, value_size], each phase in
    the form `forms` says (the loader sets them from kvferry.config.ModelConfig.mla_forms)."""

    def __init__(self, layer_name: str, num_heads: int, latent_size: int, value_size: int, scale: float):
        super().__init__(layer_name)
        self.num_heads = num_heads
        self.latent_size = latent_size
        self.value_size = value_size
        self.scale = scale
        self.forms = MLAForms()

    def kv_layer(self) -> AttentionLayerKV:
        head_size = latent_head_size(self.latent_size)
        return AttentionLayerKV(self.layer_name, 1, head_size, latent_size=self.latent_size)

    def forward(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        rows: torch.Tensor,
        kv_b: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.value_size)
        graph_ops.before_attention(self.hooks, out, ctx, self.layer_name)
        latent_attend(
            q_nope,
            q_rope,
            rows,
            kv_b,
            out,
            ctx,
            self.layer_name,
            self.scale,
            self.forms.decode is MLAForm.ABSORBED,
            self.forms.prefill is MLAForm.ABSORBED,
        )
        graph_ops.after_attention(self.hooks, out, ctx, self.layer_name)
        return out


def set_mla_forms(model: nn.Module, forms: MLAForms) -> int:
    """Make every latent-attention layer of `model` compute in `forms`; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, LatentAttention)]
    for layer in layers:
        layer.forms = forms
    if layers:
        logger.info("MLA: prefill %s, decode %s (%d layers)", forms.prefill, forms.decode, len(layers))
    return len(layers)
