"""GGUF-block linears for the CPU (`--quantization gguf`): a checkpoint's Q4_0, Q4_1 and
Q8_0 weights kept as the file stores them and multiplied directly (layers.gguf_kernel).

A decode step at small batches reads every weight once per token. Kept as blocks, the
embedded SmolLM2's Q4_1 layers read 5 bits per weight (not 32), and its tied Q8_0
embedding serves as an 8.5-bit LM head (not float32's 113 MB a token). Each call of up to
`MAX_GGUF_ROWS` rows quantizes its rows to int8 per block of 32 (the only rounding besides
the checkpoint's own: at most half a step of max|x| / 127 per input) and sums in integers;
calls with more rows (prefill chunks) use the dense float32 weight (the blocks
dequantized), which is kept, as under int4. Outputs therefore depend on the step's row
count: not batch-invariant past that limit, and P/D is not byte-identical to colocated
under this mode (float32's guarantees).

The limit covers decode batches: on a 2-core AVX-512 EPYC the tiled kernel took 0.9 ms
for SmolLM2's gate_up weight at 64 rows where the packed float32 GEMM took 4.8 (Q8_0 LM
head: 23 against 36 ms; the kernel stayed ahead up to 1,024 rows; docs/benchmarks.md).
Prefill chunks keep the dense GEMM until the two are measured on an AVX2-only CPU, whose
integer path takes three instructions where VNNI takes one.
"""

from __future__ import annotations

import torch
from torch._library.opaque_object import MemberType, register_opaque_type

from kvferry.model.layers.dense_fallback import DenseFallbackWeight, quantized_linear
from kvferry.model.layers.gguf_kernel import GGUFBlocks, gguf_matmul
from kvferry.model.layers.packed import PackedWeight
from kvferry.model.operators import operator

# Rows up to which the block kernel runs, above which the dense float32 GEMM does.
MAX_GGUF_ROWS = 64


class GGUFWeight(DenseFallbackWeight):
    """An [out, in] weight as the GGUF file's blocks, and the dense weight for calls with
    more rows than the block kernel is fast for."""

    def __init__(self, blocks: GGUFBlocks, dense: PackedWeight | torch.Tensor):
        self.blocks = blocks
        blocks.tiles  # noqa: B018  # the kernel's layout, made at load rather than by a first step
        self.out_features = blocks.out_features
        self.dense = dense
        self.max_rows = MAX_GGUF_ROWS

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
    def block_kernel(rows: torch.Tensor) -> torch.Tensor:
        if rows.dtype == torch.float32:  # no cast dispatched that would change nothing
            return gguf_matmul(rows, weight.blocks)
        return gguf_matmul(rows.float(), weight.blocks).to(rows.dtype)

    return quantized_linear(x, weight, bias, out_features, block_kernel)


@gguf_linear_op.register_fake
def _(x: torch.Tensor, weight: GGUFWeight, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
