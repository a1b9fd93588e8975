"""How much KV memory a rank reserves and commits (what tests and metrics read)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVMemoryUsage:
    """One rank's KV memory now: reserved, committed by the allocator's accounting, and
    resident by the kernel's word (mincore). Eager memory is all three from the start."""

    reserved_bytes: int
    mapped_bytes: int
    resident_bytes: int
    pages_mapped: int


@dataclass(frozen=True)
class KVMemoryStats:
    """The scheduler's account of the engine's KV memory, all ranks together: what
    `/metrics` shows. Eager memory is committed whole; elastic memory commits the pages the
    workers hold now. The pool fields stay 0 without a shared KV memory pool."""

    reserved_bytes: int = 0  # the capacity (address space, elastic; memory, eager)
    committed_bytes: int = 0  # pages mapped by the workers now
    pages_mapped: int = 0
    pages_mapped_total: int = 0  # pages the workers were told to map, since start
    pages_returned_total: int = 0  # ... and to return
    pool_size_bytes: int = 0  # the shared pool's budget
    pool_used_bytes: int = 0  # held by every engine on the pool
    pool_held_bytes: int = 0  # held by this engine


@dataclass(frozen=True)
class KVGroupStats:
    """One KV cache group now: what its requests hold, and what its window saved."""

    group: int
    kind: str  # "full" or "window N"
    num_layers: int
    blocks_in_use: int  # distinct blocks its requests hold
    bytes_in_use: int  # the memory those blocks take, all tensors and ranks
    blocks_clipped_total: int  # blocks full attention would have held, since start
