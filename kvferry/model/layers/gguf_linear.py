"""GGUF-block linears for the CPU (`--quantization gguf`): a checkpoint's Q4_0, Q4_1 and
Q8_0 weights kept as the file stores them and multiplied directly (layers.gguf_kernel).

Every call, decode batch or prefill chunk, runs the block kernel: it quantizes its rows
to int8 per block of 32 (the only rounding besides the checkpoint's own: at most half a
step of max|x| / 127 per input) and sums in integers. No dense copy of a weight is kept:
the embedded SmolLM2's Q4_1 layers hold 5 bits per weight in memory (not 32), and its tied
Q8_0 embedding serves as an 8.5-bit LM head. A row's output does not depend on the rows
that share its call; with the fused layer computing a decode row alike in every step
(layers.fused_decode), P/D is byte-identical to colocated serving under this mode.

The kernel against the packed float32 GEMM, SmolLM2's four layer linears at 64 to 2,048
rows on a 2-core AVX-512 EPYC: 1.5x faster at every count with VNNI; built for AVX2 on the
same CPU, 0.93x to 1.07x the GEMM's time (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
from torch._library.opaque_object import MemberType, register_opaque_type

from kvferry.model.layers.dense_fallback import KeyedByType
from kvferry.model.layers.gguf_kernel import GGUFBlocks, gguf_matmul
from kvferry.model.operators import operator


class GGUFWeight(KeyedByType):
    """An [out, in] weight as the GGUF file's blocks (and the kernel's tiles of them)."""

    def __init__(self, blocks: GGUFBlocks):
        self.blocks = blocks
        blocks.tiles  # noqa: B018  # the kernel's layout, made at load rather than by a first step
        self.out_features = blocks.out_features

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = gguf_linear_op(x, self, bias, self.out_features)
        return out


register_opaque_type(
    GGUFWeight, typ="reference", members={"out_features": MemberType.USE_REAL, "linear": MemberType.INLINED}
)


@operator("gguf_linear", mutates_args=())
def gguf_linear_op(
    x: torch.Tensor, weight: GGUFWeight, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [..., in] times the blocks. A decode step makes ~120 such calls with x [rows, in]
    in float32: no reshape or cast is dispatched that would change nothing."""
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, x.shape[-1])
    out = gguf_matmul(rows if rows.dtype == torch.float32 else rows.float(), weight.blocks)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if not flat:
        out = out.reshape(*x.shape[:-1], out_features)
    return out if bias is None else out + bias


@gguf_linear_op.register_fake
def _(x: torch.Tensor, weight: GGUFWeight, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
