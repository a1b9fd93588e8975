"""Paged attention over a block KV cache (torch SDPA; CPU and CUDA).

Per forward: write this step's k/v into the cache at `slot_mapping`, attend the decode
tokens in one batched op over their gathered blocks, then each prefill span (causal,
offset by its context length). Connector hooks wrap the layer: `wait_for_layer_load`
before touching the cache, `save_kv_layer` once the new k/v are written.

A sliding-window layer (`window` W > 0) lets the token at position p see positions
p - W + 1 .. p only (transformers' convention); prefill spans gather only the blocks
their window reaches (a span's own keys come from the step, not the cache), so blocks
older than that, and positions of a chunk no later token sees, may be the null block
(the window's KV cache group frees them or never allocates them).

The cache must hold finite values everywhere (allocate it zeroed): padded decode slots
are masked out, but NaN/inf garbage would still poison the weighted sum.

A cache may store heads wider than the layer's (KV cache groups padded to one page size,
kvferry.kv.allocate): the layer writes its heads zero-padded and reads back the first
`head_dim` values of each. A layer that shares another layer's KV (`kv_owner`) reads the
owner's cache and metadata, attends the owner's k/v of the step, and writes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.kv.spec import AttentionLayerKV, Layout
from kvferry.model import graph_ops
from kvferry.model.forward_context import (
    AttentionMetadata,
    ForwardContext,
    HookPlacement,
    PrefillSpan,
    Workspace,
)
from kvferry.model.layers.decode_kernel import decode_kernel_available, paged_decode, write_kv_slots
from kvferry.model.layers.prefill_kernel import fresh_prefill, paged_prefill, takes_prefill
from kvferry.model.operators import operator

logger = logging.getLogger(__name__)


def write_kv(
    kv_cache: torch.Tensor, layout: Layout, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store k, v [T, kv_heads, head_dim] at flat slots (block_id * block_size + offset),
    zero-padded to the cache's head size when it stores wider heads. On CPU, a cache of k's
    dtype and head size is written by the kernel library in one call."""
    pad = kv_cache.shape[-1] - k.shape[-1]
    if not pad and k.dtype == kv_cache.dtype and k.device.type == "cpu" and decode_kernel_available():
        write_kv_slots(kv_cache, layout, k, v, slots)
        return
    if pad:
        k, v = F.pad(k, (0, pad)), F.pad(v, (0, pad))
    if k.dtype != kv_cache.dtype:
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if layout is Layout.NHD:
        flat = kv_cache.flatten(1, 2)  # [2, num_blocks * block_size, H, D] (a view)
        flat[0].index_copy_(0, slots, k)
        flat[1].index_copy_(0, slots, v)
        return
    block_size = kv_cache.shape[3]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0][blocks, :, offsets] = k
    kv_cache[1][blocks, :, offsets] = v


def gather_kv(
    kv_cache: torch.Tensor, layout: Layout, block_table: torch.Tensor, workspace: Workspace | None = None
) -> torch.Tensor:
    """KV of the blocks in `block_table` [..., n] as [2, ..., kv_heads, n * block_size, head_dim].

    One index_select of contiguous chunks for K and V together: whole blocks for NHD (the
    result is a transposed view), (block, head) rows for HND (the result is contiguous).
    """
    lead = block_table.shape[:-1]
    if layout is Layout.NHD:
        num_blocks, block_size, heads, head_dim = kv_cache.shape[1:]
        index = block_table.flatten()
        rows = _select(kv_cache.view(2, num_blocks, -1), index, workspace)
        return rows.view(2, *lead, -1, heads, head_dim).transpose(-3, -2)
    num_blocks, heads, block_size, head_dim = kv_cache.shape[1:]
    head_ids = torch.arange(heads, device=block_table.device).unsqueeze(1)
    index = (block_table.unsqueeze(-2) * heads + head_ids).flatten()  # [..., H, n] (block, head) rows
    rows = _select(kv_cache.view(2, num_blocks * heads, -1), index, workspace)
    return rows.view(2, *lead, heads, -1, head_dim)


def _select(rows: torch.Tensor, index: torch.Tensor, workspace: Workspace | None) -> torch.Tensor:
    if workspace is None:
        return rows.index_select(1, index)
    out = workspace.take((2, index.numel(), rows.shape[2]), rows.dtype, rows.device)
    return torch.index_select(rows, 1, index, out=out)


def fresh_runs(spans: list[PrefillSpan]) -> list[list[PrefillSpan]]:
    """Spans in order, grouped into runs of adjacent spans with no cached context and equal
    lengths (a batch of same-length prompts: one attention call instead of one per span);
    any other span is a run of its own."""
    runs: list[list[PrefillSpan]] = []
    for span in spans:
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and span.context_len == last.context_len == 0
            and span.query_len == last.query_len
            and span.query_start == last.query_start + last.query_len
        ):
            runs[-1].append(span)
        else:
            runs.append([span])
    return runs


# Python reading the step's context: never replayed from a CUDA graph (the graph is cut here).
@operator("paged_attention", mutates_args=("out",), tags=(torch.Tag.cudagraph_unsafe,))
def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    ctx: ForwardContext,
    layer_name: str,
    scale: float,
    window: int,
    write: bool = True,
) -> None:
    """One layer's paged attention into `out`: q [T, heads, D], k and v [T, kv_heads, D].

    `window` > 0: a sliding window of that many positions (0: full attention).
    `layer_name` is the layer owning the KV cache; `write` False: a layer sharing that
    cache (its k/v are the owner's, already written this step).

    Writes this step's k/v into the layer's cache, then attends the decodes in one call and
    each run of prefill spans. This is the `kvferry::paged_attention` operator: a captured
    graph calls it with each step's own context. Rows
    past the step's tokens (a batch padded for a captured graph) are written as zeros.
    """
    attn = ctx.attn_for(layer_name)
    kv_cache = ctx.kv_caches[layer_name]
    num_tokens = attn.slot_mapping.numel()  # rows past it pad a captured batch: zeros out
    if q.shape[0] > num_tokens:
        out[num_tokens:].zero_()
        k, v = k[:num_tokens], v[:num_tokens]
    if write:
        write_kv(kv_cache, ctx.layout, k, v, attn.slot_mapping)
    score = Scores(scale, window)
    if attn.num_decodes:
        _decode(q[: attn.num_decodes], kv_cache, ctx, attn, score, out[: attn.num_decodes])
    for run in fresh_runs(attn.prefills):
        rows = slice(run[0].query_start, run[-1].query_start + run[-1].query_len)
        if len(run) > 1:
            out[rows] = _fresh_batch(q[rows], k[rows], v[rows], len(run), score)
        else:
            out[rows] = _prefill(q[rows], k[rows], v[rows], kv_cache, ctx, run[0], score)


@dataclass(frozen=True)
class Scores:
    """How a layer turns q.k into weights: scale, and the sliding window (0: none)."""

    scale: float
    window: int = 0

    def mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Bool [..., Lq, Lk]: key visible to query (causal, and inside the window)."""
        diff = query_pos.unsqueeze(-1) - key_pos.unsqueeze(-2)
        visible = diff >= 0
        return visible & (diff < self.window) if self.window else visible

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [B, Hq, Lq, D] over k, v [B, Hkv, Lk, D] (Hq a multiple of Hkv); mask None: causal."""
        gqa = q.shape[-3] != k.shape[-3]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=gqa
        )

    def fresh_mask(self, length: int, device: torch.device) -> torch.Tensor | None:
        """Mask of a span with no cached context: None (plain causal) unless the window cuts it."""
        if not self.window or self.window >= length:
            return None
        pos = torch.arange(length, device=device)
        return self.mask(pos, pos)


def _decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    ctx: ForwardContext,
    attn: AttentionMetadata,
    score: Scores,
    out: torch.Tensor,
) -> None:
    """All decode tokens into `out` (the layer's first rows): on CPU the paged decode
    kernel (reads the cache in place), else (no kernel for this device, or it could not be
    built) one SDPA call over gathered KV."""
    if q.device.type == "cpu" and q.dtype == kv_cache.dtype and decode_kernel_available():
        paged_decode(
            q,
            kv_cache,
            ctx.layout,
            attn.decode_block_table,
            attn.decode_seq_lens,
            attn.decode_start_pos,
            score.window,
            score.scale,
            out,
        )
        return
    out.copy_(_decode_sdpa(q, kv_cache, ctx, attn, score))


def _decode_sdpa(
    q: torch.Tensor, kv_cache: torch.Tensor, ctx: ForwardContext, attn: AttentionMetadata, score: Scores
) -> torch.Tensor:
    """All decode tokens in one SDPA call; a query head group shares its KV head."""
    batch, heads, head_dim = q.shape
    kv = gather_kv(kv_cache, ctx.layout, attn.decode_block_table, ctx.workspace)  # [2, B, H, L, D]
    kv = kv[..., :head_dim].to(q.dtype)
    kv_heads, length = kv.shape[2], kv.shape[3]
    mask = decode_mask(attn, score, length, q.device)
    # [B, heads, D] -> [B, kv_heads, group, D]: the group's queries attend the same KV
    grouped = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, kv[0], kv[1], attn_mask=mask, scale=score.scale)
    return out.reshape(batch, heads, head_dim)


def decode_mask(attn: AttentionMetadata, score: Scores, length: int, device: torch.device) -> torch.Tensor:
    """Bool [B, 1, 1, length]: the keys each decode sees. Equal for every layer of a window
    in a step: built once per step and window, not once per layer."""
    cached = attn.decode_masks.get((score.window, length))
    if cached is not None:
        return cached
    batch = attn.num_decodes
    key_pos = torch.arange(length, device=device)  # [L], or [B, L] from each table's start
    if attn.decode_start_pos is not None:
        key_pos = key_pos + attn.decode_start_pos.unsqueeze(1)
    query_pos = (attn.decode_seq_lens - 1).view(batch, 1)  # [B, 1]: one query each
    mask = score.mask(query_pos, key_pos).view(batch, 1, 1, length)
    attn.decode_masks[(score.window, length)] = mask
    return mask


def _fresh_batch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, score: Scores
) -> torch.Tensor:
    """`count` adjacent equal-length spans without cached context, in one call: the CPU
    prefill kernel where it serves these dtypes, else one causal SDPA call."""
    if takes_prefill(q, k, v):
        return fresh_prefill(q, k, v, count, score.window, score.scale)
    return _fresh_batch_sdpa(q, k, v, count, score)


def _fresh_batch_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, score: Scores
) -> torch.Tensor:
    """`count` adjacent equal-length spans without cached context, in one causal SDPA call."""

    def batched(x: torch.Tensor) -> torch.Tensor:  # [count * L, H, D] -> [count, H, L, D]
        return x.view(count, -1, *x.shape[1:]).transpose(1, 2)

    mask = score.fresh_mask(q.shape[0] // count, q.device)
    out = score.attend(batched(q), batched(k), batched(v), mask)
    return out.transpose(1, 2).flatten(0, 1)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    ctx: ForwardContext,
    span: PrefillSpan,
    score: Scores,
) -> torch.Tensor:
    """One span: causal over its own tokens, plus what it sees of its cached context. The
    CPU prefill kernel where it serves these dtypes (it reads the context in place from
    the cache), else SDPA over the gathered context."""
    cache_ok = span.context_len == 0 or kv_cache.dtype == q.dtype
    if cache_ok and takes_prefill(q, k, v):
        block_size = kv_cache.shape[2] if ctx.layout is Layout.NHD else kv_cache.shape[3]
        start = _first_visible_block(span.context_len, score.window, block_size) * block_size
        return paged_prefill(
            q,
            k,
            v,
            kv_cache,
            ctx.layout,
            span.block_table,
            span.context_len,
            start,
            score.window,
            score.scale,
        )
    return _prefill_sdpa(q, k, v, kv_cache, ctx, span, score)


def _prefill_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    ctx: ForwardContext,
    span: PrefillSpan,
    score: Scores,
) -> torch.Tensor:
    """One span in one SDPA call: causal over its own tokens, plus what it sees of its
    cached context (gathered from the cache)."""
    # 4-D [1, heads, L, D]: torch's CPU flash kernel only takes batched inputs; 3-D ones
    # fall back to a path ~6x slower on a 1,500-token prompt.
    q = q.transpose(0, 1).unsqueeze(0)
    if span.context_len == 0:
        keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        out = score.attend(q, keys, values, score.fresh_mask(span.query_len, q.device))
        return out.squeeze(0).transpose(0, 1)
    keys, values, start = _span_kv(k, v, kv_cache, ctx, span, score.window)
    total = span.context_len + span.query_len
    query_pos = torch.arange(span.query_len, device=q.device) + span.context_len
    mask = score.mask(query_pos, torch.arange(start, total, device=q.device))  # [Lq, total - start]
    out = score.attend(q, keys.to(q.dtype).unsqueeze(0), values.to(q.dtype).unsqueeze(0), mask)
    return out.squeeze(0).transpose(0, 1)


def _span_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    ctx: ForwardContext,
    span: PrefillSpan,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Keys and values [kv_heads, L, D] a span attends to, and the position of the first.

    Full attention: the whole sequence, gathered from the cache (the step's k/v are
    written already). Sliding window: the cached context from the first block the window
    reaches, then the span's own k/v from the step: a sliding-window group leaves chunk
    positions no later token sees in the null block, so the cache does not hold them.
    """
    context, total = span.context_len, span.context_len + span.query_len
    block_size = kv_cache.shape[2] if ctx.layout is Layout.NHD else kv_cache.shape[3]
    if not window:
        kv = gather_kv(kv_cache, ctx.layout, span.block_table[: -(-total // block_size)], ctx.workspace)
        kv = kv[..., : k.shape[-1]]
        return kv[0, :, :total], kv[1, :, :total], 0
    first = _first_visible_block(context, window, block_size)
    table = span.block_table[first : -(-context // block_size)]
    start = first * block_size
    cached = gather_kv(kv_cache, ctx.layout, table, ctx.workspace)[:, :, : context - start, : k.shape[-1]]
    cached = cached.to(k.dtype)
    keys = torch.cat((cached[0], k.transpose(0, 1)), dim=1)
    values = torch.cat((cached[1], v.transpose(0, 1)), dim=1)
    return keys, values, start


def _first_visible_block(first_query_pos: int, window: int, block_size: int) -> int:
    """The first block a query at `first_query_pos` (or later) can see through `window`."""
    if not window:
        return 0
    return max(0, first_query_pos - window + 1) // block_size


class KVCacheLayer(nn.Module):
    """An attention layer over a paged KV cache, as the model runner and allocator see it:
    its name (the cache it binds), what it caches (`kv_layer`), and its connector hooks.

    `kv_owner`: the layer whose KV cache this one shares (Gemma 4's `num_kv_shared_layers`);
    it owns no cache, writes nothing and calls no hooks (the owner's cover its KV)."""

    def __init__(self, layer_name: str, kv_owner: str | None = None):
        super().__init__()
        self.layer_name = layer_name
        self.kv_owner = kv_owner  # None: this layer owns its KV cache
        self.hooks = HookPlacement.NONE

    @property
    def owns_kv(self) -> bool:
        return self.kv_owner is None

    def kv_layer(self) -> AttentionLayerKV:
        """What this layer keeps per token on this rank (kvferry.kv.allocate groups them)."""
        raise NotImplementedError


class PagedAttention(KVCacheLayer):
    """Attention of one layer over its paged KV cache; heads are this rank's heads.

    The attention itself is the `kvferry::paged_attention` operator (kvferry.model.graph_ops):
    a captured graph calls it on every execution with the step's context. Connector hooks
    wrap it as `hooks` says (set by the model runner from the connector's declarations).

    `kv_owner`: the layer whose KV cache this one shares (Gemma 4's `num_kv_shared_layers`);
    it owns no cache, writes nothing and calls no hooks (the owner's cover its KV).
    """

    def __init__(
        self,
        layer_name: str,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        kv_owner: str | None = None,
    ):
        super().__init__(layer_name, kv_owner)
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        assert sliding_window is None or sliding_window > 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # None: full attention

    def kv_layer(self) -> AttentionLayerKV:
        return AttentionLayerKV(self.layer_name, self.num_kv_heads, self.head_dim, self.sliding_window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q [T, heads*D] or [T, heads, D]; k, v likewise with kv_heads. Returns [T, heads*D]."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(q)
        graph_ops.before_attention(self.hooks, out, ctx, self.layer_name)
        window = self.sliding_window or 0
        cache_layer = self.kv_owner or self.layer_name
        attend(q, k, v, out, ctx, cache_layer, self.scale, window, self.kv_owner is None)
        graph_ops.after_attention(self.hooks, out, ctx, self.layer_name)
        return out.view(num_tokens, self.num_heads * self.head_dim)


@attend.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    ctx: ForwardContext,
    layer_name: str,
    scale: float,
    window: int,
    write: bool = True,
) -> None:
    return None
