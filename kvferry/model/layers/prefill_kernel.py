"""The CPU prefill attention kernel (csrc/paged_prefill.cpp): prebuilt (`kvferry
build-kernels`) or built for this machine on first use, loaded as the
`kvferry_cpu::paged_prefill` operator.

A prompt span's queries attend its cached context, read in place from the KV cache
through the block table, then the span's own k/v: flash-style tiles with a running
softmax, so no gathered KV copy and no mask tensor. bf16 on a CPU with AVX-512 BF16 runs
microkernels on _mm512_dpbf16_ps, over 2x faster than torch's CPU flash SDPA on a
1,000-token prompt; fp32 runs microkernels on AVX-512 or AVX2 + FMA lanes, faster than
torch's causal flash SDPA at prompt lengths. Both need a head width that is a multiple
of 32. Other dtypes and widths have portable fp32 tiles, which the attention layer does
not take (torch's SDPA is as fast there).

Loaded by kvferry.model.layers.cpu_kernels; if there is no library, prefill
attention stays on torch's SDPA with one warning naming the cause.
"""

from __future__ import annotations

import functools
import logging

import torch

from kvferry.kv.spec import Layout
from kvferry.model.layers import cpu_kernels
from kvferry.model.layers.decode_kernel import CacheGeometry

logger = logging.getLogger(__name__)

SOURCE = cpu_kernels.CSRC / "paged_prefill.cpp"


def paged_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: Layout,
    block_table: torch.Tensor,
    context_len: int,
    start: int,
    window: int,
    scale: float,
    portable: bool = False,
) -> torch.Tensor:
    """One span's attention: q [L, heads, D] at positions context_len .. + L - 1 over the
    cached keys at positions `start` .. context_len - 1 (the block table names the
    sequence's blocks from position 0; `start` a multiple of the block size) and the span's
    own k, v [L, kv_heads, D]. Causal; `window` > 0 limits each query to its last `window`
    positions. The cache may store heads wider than D: the first D values are read.
    `portable`: the portable tiles even where a microkernel serves these inputs."""
    geometry = CacheGeometry.of(kv_cache, layout)
    q, k, v = _rows(q), _rows(k), _rows(v)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    torch.ops.kvferry_cpu.paged_prefill(
        q,
        k,
        v,
        kv_cache,
        block_table.contiguous(),
        out,
        1,
        context_len,
        start,
        geometry.block_size,
        geometry.block_stride,
        geometry.token_stride,
        geometry.head_stride,
        geometry.kv_stride,
        window,
        scale,
        portable,
    )
    return out


def fresh_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    count: int,
    window: int,
    scale: float,
    portable: bool = False,
) -> torch.Tensor:
    """`count` adjacent spans of equal length and no cached context, q [count * L, heads, D]
    and k, v [count * L, kv_heads, D]: each span causal over its own keys."""
    q, k, v = _rows(q), _rows(k), _rows(v)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    no_cache = torch.empty(0, dtype=q.dtype)
    no_table = torch.empty(0, dtype=torch.long)
    torch.ops.kvferry_cpu.paged_prefill(
        q, k, v, no_cache, no_table, out, count, 0, 0, 0, 0, 0, 0, 0, window, scale, portable
    )
    return out


def takes_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel serves this prefill: float32 on CPU always (its microkernel, else
    its portable tiles), bf16 where a bf16 microkernel of this head width was built
    (elsewhere torch's SDPA is as fast as the portable tiles). float32 stays on the kernel
    for what it guarantees: a query row's bits do not depend on how its prompt was split
    into chunks or cached (each row folds the same key tiles in the same order), which
    SDPA's shape-dependent kernels do not promise. A span with cached context also needs a
    cache of q's dtype."""
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype
        and q.dtype in (torch.bfloat16, torch.float32)
        and prefill_kernel_available()
        and (q.dtype == torch.float32 or fast_path(q.dtype, q.shape[-1]))
    )


@functools.cache
def fast_path(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the loaded kernel has a microkernel for `dtype` at `head_dim` (fixed by the
    build: asked once, not by every layer of every prefill)."""
    return bool(torch.ops.kvferry_cpu.prefill_fast_path(dtype, head_dim))


def fp32_lanes() -> str:
    """The lanes the loaded kernel's fp32 microkernel runs on: 'avx512', 'avx2' or 'none'."""
    lanes: str = torch.ops.kvferry_cpu.prefill_fp32_lanes()
    return lanes


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel reads it: rows of contiguous values (any token and head strides, so
    views of the fused qkv projection are read in place)."""
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.cache
def prefill_kernel_available() -> bool:
    """Build (once per machine) and load the kernel; False, with one warning, if it cannot."""
    return cpu_kernels.loaded(SOURCE, logger, "prefill attention uses torch SDPA")
