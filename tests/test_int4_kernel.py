"""kvferry's int4 kernel (kvferry.model.layers.int4_kernel): equal to the dequantized
weight's float32 product rounded to bf16 on every shape and row count, taken by int4 linears
where the CPU has AVX-512 BF16, and a clean fallback to torch's kernel where it cannot run.

The arithmetic reference: bf16 inputs times the dequantized weight in float32, rounded to
bf16 (the kernel multiplies exactly and sums in float32 in another order, so a result may
round to the neighbouring bf16 value: the tolerance is one bf16 step)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvferry.model.layers import int4_kernel
from kvferry.model.layers.int4 import Int4Weight, dequantize_groups, int4_matmul, quantize_groups
from kvferry.model.layers.int4_kernel import KERNEL_MAX_ROWS, NibbleTiles, tiles_matmul

needs_kernel = pytest.mark.skipif(
    not int4_kernel.int4_kernel_available(), reason="no AVX-512 BF16 here: torch's int4 kernel is used"
)
SHAPES = [(16, 32), (48, 64), (576, 960), (3072, 576)]  # [out, in]: one tile; several; SmolLM2's


def _weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * 0.05


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS * 2 + 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_equals_the_dequantized_product(shape: tuple[int, int], rows: int, threads: int) -> None:
    q, scales_zeros = quantize_groups(_weight(shape, seed=rows))
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(7)).bfloat16()
    expected = x.float() @ dequantize_groups(q, scales_zeros).t()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = tiles_matmul(x, NibbleTiles.pack(q, scales_zeros))
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected.bfloat16(), rtol=8e-3, atol=1e-5)  # within one bf16 step


@needs_kernel
def test_int4_linears_take_the_kernel() -> None:
    """Int4Weight holds the kernel's layout (not torch's) and its product is the reference's."""
    plain = _weight((576, 960), seed=3)
    weight = Int4Weight(plain, plain)
    assert weight.tiles is not None and weight.packed is None
    x = torch.randn(KERNEL_MAX_ROWS * 2 + 3, 960, generator=torch.Generator().manual_seed(1)).bfloat16()
    q, scales_zeros = quantize_groups(plain)
    expected = (x.float() @ dequantize_groups(q, scales_zeros).t()).bfloat16()
    got = int4_matmul(x, weight)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-5)  # one bf16 step


def test_without_the_kernel_int4_linears_use_torchs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler and no cached build: one warning, torch's layout, the same product."""
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    int4_kernel.int4_kernel_available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=int4_kernel.__name__):
            plain = _weight((48, 64), seed=5)
            weight = Int4Weight(plain, plain)
            assert not int4_kernel.int4_kernel_available()  # decided once
        (record,) = caplog.records
        assert "torch's kernel" in record.message and "/nonexistent/g++" in record.message
        assert weight.tiles is None and weight.packed is not None
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
        q, scales_zeros = quantize_groups(plain)
        expected = x.float() @ dequantize_groups(q, scales_zeros).t()
        torch.testing.assert_close(int4_matmul(x, weight).float(), expected, rtol=8e-3, atol=1e-5)
    finally:
        int4_kernel.int4_kernel_available.cache_clear()
