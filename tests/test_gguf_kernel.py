"""The GGUF block kernel (csrc/gguf_matmul.cpp) against the dequantized float reference.

Each activation row is quantized to int8 per block of 32 (dx = max|x| / 127, round to
nearest even), so the kernel equals, up to float summation order, the dequantized weight
times the dequantized activation (`quantized_rows`): checked within 1e-5 of the sum of
|terms|. Against the float32 activation the difference is the activation rounding: at
most dx / 2 per input, so |error| <= sum over blocks of dx / 2 * sum |w| (the bound
`_rounding_bound` computes, asserted for every output). The vector path this machine's
library was built for and the portable scalar path (forced) are both checked.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvferry.model.layers.gguf_kernel import (
    BLOCK,
    SOURCE,
    BlockType,
    GGUFBlocks,
    gguf_kernel_available,
    gguf_matmul,
)
from kvferry.model.loader.gguf_dequant import dequantize
from tests.avx2_build import outputs_of_the_avx2_build

pytestmark = pytest.mark.skipif(not gguf_kernel_available(), reason="no C++ compiler for the CPU kernels")


def random_blocks(block_type: BlockType, out: int, inputs: int, gen: torch.Generator) -> GGUFBlocks:
    """Blocks as a GGUF file holds them: fp16 scales (and Q4_1's fp16 minimum), then quants."""
    count = out * inputs // BLOCK
    d = (torch.rand(count, 1, generator=gen) * 0.02 + 0.001).half().view(torch.uint8)
    if block_type is BlockType.Q8_0:
        quants = torch.randint(-128, 128, (count, BLOCK), generator=gen, dtype=torch.int8).view(torch.uint8)
        parts = [d, quants]
    else:
        quants = torch.randint(0, 256, (count, BLOCK // 2), generator=gen).to(torch.uint8)
        minimum = (torch.randn(count, 1, generator=gen) * 0.1).half().view(torch.uint8)
        parts = [d, minimum, quants] if block_type is BlockType.Q4_1 else [d, quants]
    data = torch.cat(parts, dim=1).reshape(out, -1).contiguous()
    return GGUFBlocks(block_type, data, inputs)


def dequantized(blocks: GGUFBlocks) -> torch.Tensor:
    raw = blocks.data.numpy().reshape(-1)
    return dequantize(np.asarray(raw), int(blocks.block_type), (blocks.out_features, blocks.in_features))


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: int8 per block of 32 times the block's scale."""
    groups = x.reshape(x.shape[0], -1, BLOCK)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(groups * inverse) * scale).reshape(x.shape)


def _rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    half_step = (x.reshape(x.shape[0], -1, BLOCK).abs().amax(-1) / 127 / 2).double()  # [m, blocks]
    weight_sums = weight.reshape(weight.shape[0], -1, BLOCK).abs().sum(-1).double()  # [out, blocks]
    return half_step @ weight_sums.T


@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
@pytest.mark.parametrize("block_type", list(BlockType), ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_kernel_equals_the_dequantized_reference(block_type: BlockType, portable: bool, rows: int):
    gen = torch.Generator().manual_seed(rows * 10 + int(block_type))
    blocks = random_blocks(block_type, 80, 576, gen)
    weight = dequantized(blocks)
    x = torch.randn(rows, 576, generator=gen)
    x[0, :BLOCK] = 0  # an all-zero block: scale 0
    ours = gguf_matmul(x, blocks, portable=portable)
    exact = quantized_rows(x).double() @ weight.double().T
    magnitude = quantized_rows(x).abs().double() @ weight.abs().double().T
    assert ((ours.double() - exact).abs() <= 1e-5 * magnitude + 1e-6).all()
    float_reference = x.double() @ weight.double().T
    assert ((ours.double() - float_reference).abs() <= _rounding_bound(x, weight) * 1.001 + 1e-5).all()


@pytest.mark.parametrize("block_type", list(BlockType), ids=lambda t: t.name)
def test_vector_and_portable_paths_compute_the_same_bits(block_type: BlockType):
    """Both take the same products and sums in the same order (csrc/gguf_matmul.cpp): a
    partial last tile of outputs, an odd block count, 1..9 rows."""
    gen = torch.Generator().manual_seed(7)
    blocks = random_blocks(block_type, 37, 1504, gen)
    x = torch.randn(9, 1504, generator=gen) * 3
    for rows in range(1, 10):
        assert torch.equal(gguf_matmul(x[:rows], blocks), gguf_matmul(x[:rows], blocks, portable=True)), rows


def test_a_block_count_that_does_not_match_the_inputs_is_an_error():
    gen = torch.Generator().manual_seed(1)
    blocks = random_blocks(BlockType.Q4_0, 16, 64, gen)
    with pytest.raises(RuntimeError, match="blocks a row for 96 inputs"):
        gguf_matmul(torch.randn(1, 96), blocks)


@pytest.mark.parametrize("portable", [False, True], ids=["vector", "portable"])
@pytest.mark.parametrize("block_type", list(BlockType), ids=lambda t: t.name)
def test_a_row_computes_the_same_bits_whatever_rows_share_its_call(block_type: BlockType, portable: bool):
    """Batch invariance: each row of a 1..9-row call equals, bit for bit, the row alone
    (a verifying step of speculative decoding computes a token with its drafts)."""
    gen = torch.Generator().manual_seed(int(block_type))
    blocks = random_blocks(block_type, 40, 576, gen)
    x = torch.randn(9, 576, generator=gen)
    alone = torch.cat([gguf_matmul(x[i : i + 1], blocks, portable=portable) for i in range(9)])
    for rows in range(1, 10):
        assert torch.equal(gguf_matmul(x[:rows], blocks, portable=portable), alone[:rows]), rows


_AVX2_RUN = """
import sys, torch
torch.ops.load_library(sys.argv[1])
cases = torch.load(sys.argv[2])
torch.save([torch.ops.kvferry_cpu.gguf_matmul(x, torch.ops.kvferry_cpu.gguf_pack(data, qtype), qtype, data.shape[0], False)
            for x, data, qtype in cases], sys.argv[3])
"""


@pytest.mark.slow  # builds the AVX2 library (~20 s)
def test_the_avx2_build_computes_the_bits_of_this_machines_build(tmp_path: Path) -> None:
    """Every output of the AVX2 build equals this machine's library's (on an AVX-512 CPU
    its 512-bit pass), bit for bit: each block type, even and odd block counts, 1..9 rows.
    The two passes share lanes, products and the order of every sum, so a greedy answer
    does not depend on which CPU kind served it. (On an AVX2-only CPU both are AVX2.)"""
    gen = torch.Generator().manual_seed(7)
    cases = []
    for block_type in BlockType:
        for out, inputs in ((40, 576), (17, 7 * BLOCK)):  # 18 blocks a row, and 7
            blocks = random_blocks(block_type, out, inputs, gen)
            for rows in range(1, 10):
                cases.append((torch.randn(rows, inputs, generator=gen) * 3, blocks.data, int(block_type)))
    avx2 = outputs_of_the_avx2_build(SOURCE, _AVX2_RUN, cases, tmp_path)
    assert len(avx2) == 3 * 2 * 9
    for (x, data, qtype), theirs in zip(cases, avx2, strict=True):
        ours = gguf_matmul(x, GGUFBlocks(BlockType(qtype), data, x.shape[1]))
        assert torch.equal(ours, theirs), (qtype, x.shape)
