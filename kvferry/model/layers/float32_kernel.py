"""kvferry's float32 matmul (csrc/float32_matmul.cpp): x W^T + b with the weight kept as
tiles of 16 output features, each tile one contiguous stream of its inputs' weights.

Why: a batch-1 float32 decode step is ~120 matmuls that each read a weight once, so it runs
at the speed weights come from memory. oneDNN's packed GEMM read SmolLM2's at about 21 of
the 36 GB/s two cores of this machine kind reach; these tiles read them at the rate of a
plain sum (figures in docs/benchmarks.md, "float32 decode at the weight-read limit").
At prefill sizes the same tiles compute within a few percent of oneDNN's throughput.

Every output is summed in one fixed order (fused multiply-adds over the inputs in order,
then the bias), whatever the row count, the threads or the instruction set: a row's bits
do not depend on the rows beside it (batch invariance) nor on whether the library was
built for AVX-512, AVX2 or neither. `portable=True` runs the reference loop the vector
paths are held to.

The `kvferry_cpu::float32_matmul` operator, loaded by kvferry.model.layers.cpu_kernels.
Where no library can be built or loaded, `float32_kernel_available` is False (logged once)
and float32 weights are packed for oneDNN instead (kvferry.model.layers.packed).
"""

from __future__ import annotations

import functools
import logging

import torch

from kvferry.model.layers import cpu_kernels

logger = logging.getLogger(__name__)

SOURCE = cpu_kernels.CSRC / "float32_matmul.cpp"
TILE = 16  # output features per tile
PANEL = 2 * TILE  # the tiles come in pairs (the AVX-512 path's panel)


def tile(weight: torch.Tensor) -> torch.Tensor:
    """A float32 [out, in] weight as the kernel's tiles: [t, in, 16] with t even, element
    (i, k, r) = weight[16 i + r, k], zeros past the last output feature."""
    out_features, in_features = weight.shape
    padded = -(-out_features // PANEL) * PANEL
    rows = weight.detach().to(torch.float32)
    if padded != out_features:
        rows = torch.cat([rows, rows.new_zeros(padded - out_features, in_features)])
    return rows.view(padded // TILE, TILE, in_features).transpose(1, 2).contiguous()


def float32_matmul(
    rows: torch.Tensor,
    tiles: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    portable: bool = False,
) -> torch.Tensor:
    """float32 rows [m, in] times the tiled weight, + bias: float32 [m, out_features]."""
    out: torch.Tensor = torch.ops.kvferry_cpu.float32_matmul(rows, tiles, bias, out_features, portable)
    return out


@functools.cache
def float32_kernel_available() -> bool:
    """Build (once per machine) and load the kernel; False where it cannot run here."""
    return cpu_kernels.loaded(SOURCE, logger, "float32 linears use oneDNN's packed GEMM")


def float32_kernel_isa() -> str:
    """The vector path the loaded library runs: 'avx512', 'avx2' or 'portable'."""
    isa: str = torch.ops.kvferry_cpu.float32_matmul_isa()
    return isa
