"""Which CPU kernels a model's attention and int4 linears run on this machine, in words
for the start-up log: each is chosen from what the CPU has (AVX-512 BF16) and whether its
library could be built here, so one line tells a user what their machine got."""

from __future__ import annotations

from pathlib import Path

import torch

from kvferry.config import WeightQuantization
from kvferry.cpu_features import read_cpu_features
from kvferry.model.layers import (
    decode_kernel,
    float32_kernel,
    fused_decode,
    gguf_kernel,
    int4_kernel,
    prefill_kernel,
)
from kvferry.model.layers.decode_kernel import decode_kernel_available
from kvferry.model.layers.float32_kernel import float32_kernel_available, float32_kernel_isa
from kvferry.model.layers.gguf_kernel import gguf_kernel_available, gguf_kernel_path
from kvferry.model.layers.int4_kernel import int4_kernel_available
from kvferry.model.layers.prefill_kernel import fast_path, fp32_lanes, prefill_kernel_available


def kernel_sources(quantization: WeightQuantization, dtype: torch.dtype) -> list[Path]:
    """The C++ sources a CPU model computing in `dtype` under `quantization` loads
    (cpu_kernels.build_ahead): attention always, the float32 tiles and the fused decode
    layer for a float32 model (a GGUF one computes in float32 too), the int4 tiles where
    the CPU has AVX-512 BF16 (nothing else runs them), the GGUF block kernel under gguf."""
    sources = [decode_kernel.SOURCE, prefill_kernel.SOURCE]
    if dtype == torch.float32:
        sources += [float32_kernel.SOURCE, fused_decode.SOURCE]
    if quantization is WeightQuantization.INT4 and "avx512_bf16" in read_cpu_features().flags:
        sources.append(int4_kernel.SOURCE)
    if quantization is WeightQuantization.GGUF:
        sources.append(gguf_kernel.SOURCE)
    return sources


def describe_cpu_kernels(dtype: torch.dtype, head_dims: set[int], quantization: WeightQuantization) -> str:
    """E.g. 'decode attention: kvferry paged kernel; prefill attention: kvferry float32 tiles
    (avx512); int4 linears: kvferry (AVX-512 BF16)'. `head_dims`: the attention
    layers' head sizes."""
    parts = [
        f"decode attention: {_decode_kernel()}",
        f"prefill attention: {_prefill_kernel(dtype, head_dims)}",
    ]
    if dtype == torch.float32:
        parts.append(f"float32 linears: {_float32_kernel()}")
    if quantization is WeightQuantization.INT4:
        parts.append(f"int4 linears: {_int4_kernel()}")
    if quantization is WeightQuantization.GGUF:
        parts.append(f"gguf-block linears: {_gguf_kernel()}")
    return "; ".join(parts)


def _decode_kernel() -> str:
    return "kvferry paged kernel" if decode_kernel_available() else "torch SDPA (kernel not built)"


def _prefill_kernel(dtype: torch.dtype, head_dims: set[int]) -> str:
    if dtype not in (torch.bfloat16, torch.float32):
        return f"torch SDPA ({dtype} model; the kernel serves bf16 and float32)"
    if not prefill_kernel_available():
        return "torch SDPA (kernel not built)"
    lanes = "AVX-512 BF16" if dtype == torch.bfloat16 else fp32_lanes()
    tiles = f"kvferry {_DTYPE_WORDS[dtype]} tiles ({lanes})"
    slow = sorted(dim for dim in head_dims if not fast_path(dtype, dim))
    # head sizes without a microkernel: float32 keeps the kernel's portable tiles (prefill_kernel.takes_prefill)
    other = "kvferry portable float32 tiles" if dtype == torch.float32 else "torch SDPA"
    if len(slow) == len(head_dims):
        return (
            f"{other} (no {_DTYPE_WORDS[dtype]} microkernel in this build, or head sizes not multiples of 32)"
        )
    if slow:
        return f"{tiles}, {other} for head size {slow}"
    return tiles


_DTYPE_WORDS = {torch.bfloat16: "bf16", torch.float32: "float32"}


def _float32_kernel() -> str:
    if not float32_kernel_available():
        return "oneDNN's packed GEMM (kernel not built)"
    return f"kvferry float32 tiles ({float32_kernel_isa()})"


def _int4_kernel() -> str:
    return "kvferry (AVX-512 BF16)" if int4_kernel_available() else "torch's int4 kernel"


def _gguf_kernel() -> str:
    if not gguf_kernel_available():
        return "none (kernel not built: dequantized float32)"
    return f"kvferry int8 dot products ({gguf_kernel_path()})"
