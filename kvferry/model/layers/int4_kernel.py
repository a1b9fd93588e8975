"""kvferry's own int4 matmul for a few rows (csrc/int4_matmul.cpp), on CPUs with AVX-512 BF16.

torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) dequantizes as it goes; ours keeps
each weight a nibble until a register turns it into bf16 and multiplies it with
`vdpbf16ps`, so a decode step reads half a byte per weight and little else. Same
arithmetic as the reference (the dequantized weight in float32 times the bf16-rounded
inputs; sums in fp32, in another order).

The `kvferry_cpu::int4_matmul` operator, loaded by kvferry.model.layers.cpu_kernels. Where
the CPU lacks AVX-512 BF16, or there is no library, `int4_kernel_available`
is False (logged once) and int4 linears keep torch's kernel.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from kvferry.model.layers import cpu_kernels

logger = logging.getLogger(__name__)

SOURCE = cpu_kernels.CSRC / "int4_matmul.cpp"
KERNEL_MAX_ROWS = 8  # rows the kernel multiplies at once (one accumulator each); more: in turns
TILE = 16  # output features per tile
GROUP = 32  # inputs per scale and zero point


@dataclass(frozen=True)
class NibbleTiles:
    """An int4 weight in the kernel's layout: tiles of 16 output features; per tile and
    input pair, 16 bytes holding the pair's two nibbles for each feature; bf16 scales and
    zero points per tile, group and feature (w = (q - 8) * scale + zero)."""

    packed: torch.Tensor  # uint8 [out / 16, in / 2, 16]
    scales: torch.Tensor  # bf16 [out / 16, in / 32, 16]
    zeros: torch.Tensor  # bf16 [out / 16, in / 32, 16]

    @property
    def out_features(self) -> int:
        return int(self.packed.shape[0]) * TILE

    @classmethod
    def pack(cls, q: torch.Tensor, scales_zeros: torch.Tensor) -> NibbleTiles:
        """From `quantize_groups`' result: q [out, in] in 0..15, scales and zeros [in / 32, out, 2]."""
        out_features, in_features = q.shape
        pairs = q.view(out_features // TILE, TILE, in_features // 2, 2)
        packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).permute(0, 2, 1).contiguous()

        def tiled(values: torch.Tensor) -> torch.Tensor:  # [groups, out] -> [out / 16, groups, 16]
            return values.reshape(-1, out_features // TILE, TILE).permute(1, 0, 2).contiguous()

        return cls(packed, tiled(scales_zeros[..., 0]), tiled(scales_zeros[..., 1]))


def can_tile(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return out_features % TILE == 0 and in_features % GROUP == 0


def tiles_matmul(rows: torch.Tensor, tiles: NibbleTiles) -> torch.Tensor:
    """bf16 rows [m, in] times the weight: bf16 [m, out] (float32 sums rounded once)."""
    out: torch.Tensor = torch.ops.kvferry_cpu.int4_matmul(rows, tiles.packed, tiles.scales, tiles.zeros)
    return out


@functools.cache
def int4_kernel_available() -> bool:
    """Build (once per machine) and load the kernel; False where it cannot run here."""
    if not cpu_kernels.loaded(SOURCE, logger, "int4 linears use torch's kernel"):
        return False
    if not torch.ops.kvferry_cpu.int4_supported():
        logger.info("this CPU has no AVX-512 BF16: int4 linears use torch's kernel")
        return False
    return True
