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
