"""A Llama-family decoder layer's decode step in one operator call (csrc/decode_layer.cpp)
on float32 tiles (layers.float32_kernel) or under --quantization gguf: residual add and
RMSNorm, q/k/v, rope, KV write, paged decode attention, output projection, residual add
and RMSNorm, gated SiLU MLP.

At batch 1 a small model's ~20 operators per layer, each dispatched from Python, cost as
much as its matmuls (SmolLM2's 30 layers: ~6 ms of a 13 ms eager step). The fused layer
runs them as plain loops around the kernel library's own matmul (float32 tiles or GGUF
blocks), KV write and paged decode attention: the same arithmetic for the matmuls and the
attention (the elementwise ops round as float32 loops do, within float32 rounding of
torch's).

A layer takes the fused path on an eager step (never while a forward is being compiled:
the compiled program keeps the operator-by-operator layer) whose rows are all decodes
(speculative decoding's verification rows included), at most MAX_FUSED_ROWS of them (the
decode batches it was measured on), float32, with no connector hooks on the layer (a
hook's place is between the layer's operators), a float32 KV cache of the layer's own
head size, and a single rank. Other eager float32 steps (prefills, decodes beside them,
hooks, larger batches) run the same code in parts: the operator's code before its
attention (`layer_head`), the layer's attention module, and its code after
(`layer_tail`). A decode row thus gets the same bits in any step, and P/D answers as
colocated serving does.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from kvferry.kv.spec import Layout
from kvferry.model.forward_context import ForwardContext, HookPlacement
from kvferry.model.layers import cpu_kernels
from kvferry.model.layers.attention import PagedAttention
from kvferry.model.layers.decode_kernel import decode_kernel_available
from kvferry.model.layers.gguf_linear import GGUFWeight
from kvferry.model.layers.linear import PackableLinear, RowParallelLinear
from kvferry.model.layers.norm import RMSNorm
from kvferry.model.layers.packed import PackedWeight

logger = logging.getLogger(__name__)

SOURCE = cpu_kernels.CSRC / "decode_layer.cpp"
MAX_FUSED_ROWS = 64  # decode rows a step may have for the fused path

CosSin = tuple[torch.Tensor, torch.Tensor]


FLOAT32_TILES = 0  # the type the operator gives float32 tiles (GGML's id of F32; GGUF blocks: theirs)


@functools.cache
def fused_decode_available() -> bool:
    """The fused layer's library and the attention kernels it calls are loaded (built once
    per machine); a layer's matmul kernel is loaded once its weights were packed for it."""
    if not decode_kernel_available():
        return False
    return cpu_kernels.loaded(SOURCE, logger, "decode layers run operator by operator")


@dataclass(frozen=True)
class KernelWeight:
    """A projection as the fused operator takes it: a kernel's tiles, the `type` naming
    them (FLOAT32_TILES, or a GGUF block type), and its outputs."""

    tiles: torch.Tensor
    type: int
    out_features: int

    @classmethod
    def of(cls, linear: PackableLinear) -> KernelWeight | None:
        """`linear`'s weight if it kept GGUF blocks or float32 tiles; None otherwise."""
        packed = linear.packed
        if isinstance(packed, GGUFWeight):
            blocks = packed.blocks
            return cls(blocks.tiles, int(blocks.block_type), blocks.out_features)
        if isinstance(packed, PackedWeight) and packed.tiles is not None:
            return cls(packed.tiles, FLOAT32_TILES, packed.out_features)
        return None


@dataclass(frozen=True)
class DecodeLayerParts:
    """The modules of one Llama-family decoder layer the fused path reads."""

    input_norm: RMSNorm
    qkv_proj: PackableLinear
    o_proj: RowParallelLinear
    post_norm: RMSNorm
    gate_up_proj: PackableLinear
    down_proj: RowParallelLinear
    attention: PagedAttention


@dataclass(frozen=True)
class FusedDecodeLayer:
    """One layer's weights as the fused operator takes them; `run` is its decode step."""

    attention: PagedAttention
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: KernelWeight
    qkv_bias: torch.Tensor | None
    o: KernelWeight
    o_bias: torch.Tensor | None
    gate_up: KernelWeight
    down: KernelWeight

    @classmethod
    def of(cls, parts: DecodeLayerParts) -> FusedDecodeLayer | None:
        """The fused form of a layer whose projections all kept GGUF blocks or float32 tiles,
        whose norms are float32 and whose attention owns its KV cache; None for any other
        layer."""
        linears = (parts.qkv_proj, parts.o_proj, parts.gate_up_proj, parts.down_proj)
        weights = [KernelWeight.of(linear) for linear in linears]
        kept = [weight for weight in weights if weight is not None]
        norms = (parts.input_norm.weight, parts.post_norm.weight)
        if len(kept) != len(linears) or any(norm.dtype != torch.float32 for norm in norms):
            return None
        if not parts.attention.owns_kv or parts.input_norm.eps != parts.post_norm.eps:
            return None
        if parts.o_proj.tp.size != 1 or parts.down_proj.tp.size != 1:  # no all-reduce inside
            return None
        if parts.gate_up_proj.bias is not None or parts.down_proj.bias is not None:
            return None
        if not fused_decode_available():
            return None
        qkv, o, gate_up, down = kept
        return cls(
            attention=parts.attention,
            input_norm=parts.input_norm.weight.detach(),
            post_norm=parts.post_norm.weight.detach(),
            eps=parts.input_norm.eps,
            qkv=qkv,
            qkv_bias=_bias(parts.qkv_proj),
            o=o,
            o_bias=_bias(parts.o_proj),
            gate_up=gate_up,
            down=down,
        )

    @property
    def intermediate(self) -> int:
        """The MLP's width (the gate and up projections are stacked)."""
        return self.gate_up.out_features // 2

    def run(
        self, rope: CosSin, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(MLP output, residual) of this layer over an all-decode step, as the unfused layer
        returns them; None when the step is not one the fused path takes (see the module)."""
        attention = self.attention
        rows = hidden.shape[0]
        if attention.hooks is not HookPlacement.NONE or not 0 < rows <= MAX_FUSED_ROWS:
            return None
        attn = ctx.attn_for(attention.layer_name)
        if attn.prefills or attn.num_decodes != rows or attn.slot_mapping.numel() != rows:
            return None
        cache = ctx.kv_caches[attention.layer_name]
        if (
            not hidden.is_contiguous()
            or hidden.dtype != torch.float32
            or cache.dtype != torch.float32
            or cache.shape[-1] != attention.head_dim
        ):
            return None
        cos, sin = rope
        out, carried = torch.ops.kvferry_cpu.decode_layer(
            hidden,
            residual,
            self.input_norm,
            self.post_norm,
            self.eps,
            self.qkv.tiles,
            self.qkv.type,
            self.qkv_bias,
            self.o.tiles,
            self.o.type,
            self.o_bias,
            self.gate_up.tiles,
            self.gate_up.type,
            self.down.tiles,
            self.down.type,
            cos,
            sin,
            cache,
            ctx.layout is Layout.HND,
            attn.slot_mapping,
            attn.decode_block_table,
            attn.decode_seq_lens,
            attn.decode_start_pos,
            attention.num_heads,
            attention.num_kv_heads,
            attention.head_dim,
            self.intermediate,
            attention.sliding_window or 0,
            attention.scale,
        )
        return out, carried

    def run_in_parts(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        keep_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(MLP output, residual) of this layer over any step `run` does not take (prefills,
        mixed steps, hooks, larger batches): the fused operator's own code before and after
        its attention (`layer_head`, `layer_tail`), and the layer's attention
        module between them. A decode row therefore gets the bits `run` gives it, whatever
        step it is in (a P/D decoder's pure decode steps and a colocated engine's mixed
        ones: the tail is row-independent); with `keep_rows`, the tail runs for those rows
        only. None for float32-less inputs."""
        if hidden.dtype != torch.float32 or hidden.dim() != 2 or hidden.shape[0] == 0:
            return None
        attention = self.attention
        heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        cos, sin = rope
        qkv, carried = torch.ops.kvferry_cpu.layer_head(
            hidden.contiguous(),
            residual,
            self.input_norm,
            self.eps,
            self.qkv.tiles,
            self.qkv.type,
            self.qkv_bias,
            cos,
            sin,
            heads,
            kv_heads,
            head_dim,
        )
        rows = qkv.shape[0]
        q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
        attended = attention(
            q.view(rows, heads, head_dim),
            k.view(rows, kv_heads, head_dim),
            v.view(rows, kv_heads, head_dim),
            ctx,
        ).reshape(rows, heads * head_dim)
        if keep_rows is not None:
            attended, carried = attended.index_select(0, keep_rows), carried.index_select(0, keep_rows)
        out = torch.ops.kvferry_cpu.layer_tail(
            attended,
            carried,
            self.post_norm,
            self.eps,
            self.o.tiles,
            self.o.type,
            self.o_bias,
            self.gate_up.tiles,
            self.gate_up.type,
            self.down.tiles,
            self.down.type,
            self.intermediate,
        )
        return out, carried


def _bias(linear: PackableLinear) -> torch.Tensor | None:
    bias = linear.bias
    return None if bias is None else bias.detach()
