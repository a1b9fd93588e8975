"""Vectorized torch dequantization of the common GGUF types (F32, F16, BF16, Q8_0, Q4_0, Q4_1).

Each works on a whole tensor at once, several times faster than gguf.quants' row-group
loop; other types fall back to gguf.quants.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

BLOCK = 32  # elements per block of the Q8_0 / Q4_0 / Q4_1 types
# gguf.GGMLQuantizationType values
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at byte `start` of every block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] values: low nibbles are elements 0-15, high ones 16-31."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:  # 2-byte scale, 32 int8
    return _halves(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:  # 2-byte scale, 16 bytes of nibbles (offset 8)
    return _halves(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:  # 2-byte scale, 2-byte min, 16 bytes of nibbles
    return _halves(blocks, 0) * _nibbles(blocks[:, 4:]) + _halves(blocks, 2)


BLOCK_KERNELS = {Q8_0: (34, _q8_0), Q4_0: (18, _q4_0), Q4_1: (20, _q4_1)}


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes (uint8, flat) of a tensor of `qtype` -> a new float32 tensor of `shape`."""
    data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))
    if qtype == F32:
        return data.view(torch.float32).reshape(shape)
    if qtype in (F16, BF16):
        return data.view(torch.float16 if qtype == F16 else torch.bfloat16).float().reshape(shape)
    if qtype in BLOCK_KERNELS:
        block_bytes, kernel = BLOCK_KERNELS[qtype]
        return kernel(data.view(-1, block_bytes)).reshape(shape)
    return _fallback(raw, qtype, shape)


def _fallback(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quant_shape_to_byte_shape

    kind = GGMLQuantizationType(qtype)
    array = gguf_dequantize(raw.reshape(quant_shape_to_byte_shape(shape, kind)), kind)
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).reshape(shape)
