"""kvferry's matmul of GGUF quantized blocks (csrc/gguf_matmul.cpp): Q4_0, Q4_1 and Q8_0
weights, the file's blocks rearranged once into tiles of 16 output rows (same bytes per
weight), times a few float32 rows quantized to int8 per block of 32.

The `kvferry_cpu::gguf_matmul` operator, loaded by kvferry.model.layers.cpu_kernels. Its
vector path is the one the loaded library was built for (AVX-512 BW, AVX2, or the portable
scalar one; `gguf_kernel_path`); `portable=True` forces the scalar path (tests run it on
any CPU). Where no library can be built or loaded, `gguf_kernel_available` is False
(logged once) and `--quantization gguf` keeps the dequantized float32 weights.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from enum import IntEnum

import torch

from kvferry.model.layers import cpu_kernels

logger = logging.getLogger(__name__)

SOURCE = cpu_kernels.CSRC / "gguf_matmul.cpp"
BLOCK = 32  # weights per block


class BlockType(IntEnum):
    """The GGUF block types the kernel multiplies (gguf.GGMLQuantizationType values)."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8

    @property
    def block_bytes(self) -> int:
        return {BlockType.Q4_0: 18, BlockType.Q4_1: 20, BlockType.Q8_0: 34}[self]


@dataclass(frozen=True)
class GGUFBlocks:
    """A [out, in] weight as the GGUF file's blocks: uint8 [out, in / 32 * block bytes]; and,
    made once on first use, as the kernel's tiles of 16 interleaved output rows (`tiles`)."""

    block_type: BlockType
    data: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @functools.cached_property
    def tiles(self) -> torch.Tensor:
        """uint8 [tiles, blocks, tile bytes] (csrc/gguf_matmul.cpp's `gguf_pack`)."""
        packed: torch.Tensor = torch.ops.kvferry_cpu.gguf_pack(self.data, int(self.block_type))
        return packed


def gguf_matmul(rows: torch.Tensor, blocks: GGUFBlocks, portable: bool = False) -> torch.Tensor:
    """float32 rows [m, in] times the weight: float32 [m, out]."""
    out: torch.Tensor = torch.ops.kvferry_cpu.gguf_matmul(
        rows, blocks.tiles, int(blocks.block_type), blocks.out_features, portable
    )
    return out


@functools.cache
def gguf_kernel_available() -> bool:
    """Build (once per machine) and load the kernel; False where it cannot run here."""
    return cpu_kernels.loaded(SOURCE, logger, "gguf blocks are dequantized to float32")


def gguf_kernel_path() -> str:
    """The vector path the loaded library runs: 'avx512', 'avx2' or 'portable'."""
    path: str = torch.ops.kvferry_cpu.gguf_matmul_path()
    return path
