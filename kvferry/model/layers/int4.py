"""Weight-only int4 linears for the CPU (`--quantization int4`): a decode-latency mode.

A decode step at small batches reads every weight once per token, so its time is the
weights' bytes over memory bandwidth. Stored as 4-bit integers in groups of 32 input
features with a bfloat16 scale and zero point per group, a weight takes 1/8 of its
float32 bytes. Where the CPU has AVX-512 BF16, kvferry's own kernel
(layers.int4_kernel) multiplies bfloat16 activations by it: 1.2-2x faster per call than
torch's CPU kernel (`_weight_int4pack_mm_for_cpu`, used elsewhere) on one thread, a
batch-1 step 10% faster on one thread and even on two (docs/benchmarks.md). Past a few rows
the dense GEMM wins, so calls with more rows (prefill chunks, large decode batches) use
the dense weight, which is kept (weights take 1/8 more memory in float32, 1/4 in bf16).

Numbers therefore depend on the step's row count (int4 up to `max_rows`, dense above),
and the kernel's bfloat16 activations magnify float32's last-bit differences: outputs
are not batch-invariant and P/D is not byte-identical to colocated under int4. Those are
float32 (the default) guarantees.

The quantization is round-to-nearest, asymmetric per group: w ~ (q - 8) * scale + zero,
q in 0..15. A GGUF Q4_0/Q4_1 checkpoint (the embedded SmolLM2) already holds weights of
that form in groups of 32, so for it int4 loses only the scales' rounding to bfloat16.
Weights whose shapes the kernel cannot take stay dense.
"""

from __future__ import annotations

import torch
from torch._library.opaque_object import MemberType, register_opaque_type

from kvferry.model.layers.dense_fallback import DenseFallbackWeight, quantized_linear
from kvferry.model.layers.int4_kernel import NibbleTiles, can_tile, int4_kernel_available, tiles_matmul
from kvferry.model.layers.packed import PackedWeight
from kvferry.model.operators import operator

GROUP_SIZE = 32  # input features per scale and zero point (GGUF's Q4 block)
INNER_K_TILES = 2  # the CPU kernel's packing parameter


def can_quantize_int4(weight: torch.Tensor) -> bool:
    """A 2-D CPU weight whose input width splits into whole groups (and packs evenly)."""
    out_features, in_features = weight.shape
    return (
        weight.device.type == "cpu"
        and in_features % GROUP_SIZE == 0
        and in_features % (INNER_K_TILES * 16) == 0
        and out_features % 16 == 0
    )


# Rows up to which the int4 kernel beats the dense GEMM, by the dense weight's dtype.
# Measured (2 threads, SmolLM2's 576x3072 and 1536x576, 2-vCPU AMX Xeon): against
# oneDNN's packed float32 int4 wins to 8 rows (65 vs 247 us at 1, 192 vs 281 at 8, even
# at 16); against bf16 on AMX to 2 (65 vs 113 at 1, 102 vs 122 at 4, 192 vs 123 at 8).
MAX_INT4_ROWS = {torch.float32: 8, torch.bfloat16: 2, torch.float16: 2}


class Int4Weight(DenseFallbackWeight):
    """An [out, in] weight as int4 values plus per-group bf16 scales and zeros (in
    kvferry's kernel's layout where it runs, else torch's), and the dense weight for
    calls with more rows than the int4 kernel is fast for (prefill chunks, large decode
    batches: there the GEMM is compute-bound and the dense kernel wins by up to 5x)."""

    def __init__(self, weight: torch.Tensor, dense: PackedWeight | torch.Tensor):
        q, scales_zeros = quantize_groups(weight.detach().float())
        self.tiles: NibbleTiles | None = None
        self.packed: torch.Tensor | None = None
        if can_tile(weight) and int4_kernel_available():
            self.tiles = NibbleTiles.pack(q, scales_zeros)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
        self.scales_zeros = scales_zeros  # [in / GROUP_SIZE, out, 2]
        self.out_features = int(weight.shape[0])
        self.dense = dense
        self.max_rows = MAX_INT4_ROWS.get(weight.dtype, 8)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = int4_linear_op(x, self, bias, self.out_features)
        return out


register_opaque_type(
    Int4Weight, typ="reference", members={"out_features": MemberType.USE_REAL, "linear": MemberType.INLINED}
)


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric int4 per group: (q [out, in] int32 in 0..15,
    scales and zeros [in / GROUP_SIZE, out, 2] bf16) with w ~ (q - 8) * scale + zero."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.bfloat16).tiny).bfloat16()
    zero = (low + 8 * scale.float()).bfloat16()
    base = zero.float() - 8 * scale.float()  # the value q = 0 stands for, as the kernel sees it
    q = ((groups - base[..., None]) / scale.float()[..., None]).round().clamp(0, 15)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return q.reshape(out_features, in_features).to(torch.int32), scales_zeros


def dequantize_groups(q: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The float32 [out, in] weight that `quantize_groups`' result stands for."""
    scale, zero = (
        scales_zeros[..., i].float().transpose(0, 1).repeat_interleave(GROUP_SIZE, 1) for i in (0, 1)
    )
    return (q.float() - 8) * scale + zero


def int4_matmul(rows: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """[m, in] bf16 rows times the int4 weight: [m, out] bf16 (rounded from float32 sums)."""
    if weight.tiles is not None:
        return tiles_matmul(rows, weight.tiles)
    assert weight.packed is not None
    out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
        rows, weight.packed, GROUP_SIZE, weight.scales_zeros
    )
    return out


@operator("int4_linear", mutates_args=())
def int4_linear_op(
    x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return quantized_linear(
        x,
        weight,
        bias,
        out_features,
        lambda rows: int4_matmul(rows.to(torch.bfloat16), weight).to(rows.dtype),
    )


@int4_linear_op.register_fake
def _(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
