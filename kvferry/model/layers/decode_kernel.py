"""The CPU paged decode attention kernel (csrc/paged_decode.cpp): prebuilt (`kvferry
build-kernels`) or built for this machine on first use, loaded as the
`kvferry_cpu::paged_decode` operator.

Each decode query reads its keys and values in place from the KV cache through its block
table, in fp32 whatever the cache dtype: no gathered copy of the KV, no mask tensor, and
one parallel loop over (sequence, KV head) instead of the SDPA kernel's per-call set-up,
which dominated decode attention at batch 64 (docs/benchmarks.md, "Decode attention").

kvferry.model.layers.cpu_kernels picks the library. If there is none, decode attention
stays on torch's SDPA with one warning naming the cause.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from kvferry.kv.spec import Layout
from kvferry.model.layers import cpu_kernels

logger = logging.getLogger(__name__)

SOURCE = cpu_kernels.CSRC / "paged_decode.cpp"


@dataclass(frozen=True)
class CacheGeometry:
    """Where a key sits in a KV cache tensor, in elements: K at 0, V at `kv_stride`; the
    tensor's KV heads."""

    kv_heads: int
    block_size: int
    block_stride: int
    token_stride: int
    head_stride: int
    kv_stride: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor, layout: Layout) -> CacheGeometry:
        """NHD [2, blocks, block_size, heads, D]; HND [2, blocks, heads, block_size, D]."""
        token_dim, head_dim = (2, 3) if layout is Layout.NHD else (3, 2)
        return cls(
            kv_heads=kv_cache.shape[head_dim],
            block_size=kv_cache.shape[token_dim],
            block_stride=kv_cache.stride(1),
            token_stride=kv_cache.stride(token_dim),
            head_stride=kv_cache.stride(head_dim),
            kv_stride=kv_cache.stride(0),
        )


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: Layout,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start_pos: torch.Tensor | None,
    window: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of decode queries q [B, heads, D] over their cached keys: [B, heads, D],
    into `out` when given (q's shape and dtype, e.g. a layer's output rows; copied there when
    it is not contiguous).

    `block_table` [B, n] int64 names each sequence's blocks from the one holding position
    `start_pos` (None: 0); `seq_lens` counts positions including the query's own (already
    written). `window` > 0 limits the keys to the last `window` positions. The cache may
    store heads wider than D (padded groups): the first D values of each are read.
    """
    q = q.contiguous()
    into = out if out is not None and out.is_contiguous() else torch.empty_like(q)
    geometry = CacheGeometry.of(kv_cache, layout)
    starts = start_pos if start_pos is not None else torch.zeros_like(seq_lens)
    torch.ops.kvferry_cpu.paged_decode(
        q,
        kv_cache,
        block_table.contiguous(),
        seq_lens,
        starts,
        into,
        geometry.kv_heads,
        geometry.block_size,
        geometry.block_stride,
        geometry.token_stride,
        geometry.head_stride,
        geometry.kv_stride,
        window,
        scale,
    )
    if out is not None and into is not out:
        out.copy_(into)
        return out
    return into


def write_kv_slots(
    kv_cache: torch.Tensor, layout: Layout, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """k, v [T, kv_heads, D] into the cache at flat slots, in one call of the kernel library
    (`kvferry_cpu::write_kv`): the cache's dtype and head size are k's, and the kernel is
    loaded (`decode_kernel_available`)."""
    geometry = CacheGeometry.of(kv_cache, layout)
    torch.ops.kvferry_cpu.write_kv(
        kv_cache,
        k,
        v,
        slots,
        geometry.block_size,
        geometry.block_stride,
        geometry.token_stride,
        geometry.head_stride,
        geometry.kv_stride,
    )


@functools.cache
def decode_kernel_available() -> bool:
    """Build (once per machine) and load the kernel; False, with one warning, if it cannot."""
    return cpu_kernels.loaded(SOURCE, logger, "decode attention uses torch SDPA")
