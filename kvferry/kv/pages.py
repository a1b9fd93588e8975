"""Physical pages of elastic KV memory, as block ids see them.

A page is a run of `blocks_per_page` block ids. In every KV tensor the K bytes of those
blocks fill whole pages of the allocator's granularity, and so do their V bytes; mapping
page p maps both ranges in every tensor (hybrid allocation: one block id means the same
bytes in every tensor, so a page is per block id across all tensors).

The scheduler's block pool decides which pages hold blocks in use (`PageChanges`); the
workers' allocators map and return them. Nothing here touches memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvferry.kv.spec import KVCacheGroup


@dataclass(frozen=True)
class PageChanges:
    """Pages to map before this step and pages to return, since the last step's changes.

    `full_sync` (the first changes an engine sends): `mapped` lists every page in use and
    every other page is to be returned, whatever a worker did with it before (warm-up and
    profiling write blocks the pool never handed out).
    """

    mapped: tuple[int, ...] = ()
    unmapped: tuple[int, ...] = ()
    full_sync: bool = False

    @property
    def is_empty(self) -> bool:
        return not (self.mapped or self.unmapped or self.full_sync)


def blocks_per_page(groups: Iterable[KVCacheGroup], granularity: int) -> int:
    """The fewest blocks whose K bytes (and V bytes) fill whole `granularity`-byte pages on
    every tensor-parallel rank: computed per KV head, so ranks holding different numbers of
    heads agree on it."""
    per_head = [g.spec.block_size * g.spec.head_size * g.spec.dtype.itemsize for g in groups]
    return math.lcm(*(granularity // math.gcd(granularity, unit) for unit in per_head))


def page_runs(pages: Iterable[int]) -> Iterator[tuple[int, int]]:
    """(first page, count) of each run of consecutive pages, in ascending order."""
    first, count = -1, 0
    for page in sorted(pages):
        if count and page == first + count:
            count += 1
            continue
        if count:
            yield first, count
        first, count = page, 1
    if count:
        yield first, count
