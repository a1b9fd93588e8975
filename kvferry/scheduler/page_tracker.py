"""Which physical pages of elastic KV memory hold blocks in use (pure bookkeeping).

A page (kvferry.kv.pages) is `blocks_per_page` consecutive block ids. A block *pins* its
page while a request holds it (ref > 0) or while it holds a cached prefix (hash set, even
with no reference): a cached block is worth the memory it sits in until the pool evicts
it for reuse or the prefix cache is reset. A page is mapped exactly while one of its blocks
pins it; the workers learn the transitions from `take_changes`, once per step.

Free blocks that hold no prefix are *spare*. The pool hands out spare blocks of mapped
pages first, then a block of an unmapped page (lowest first), and evicts a cached block
only when neither exists: a page is never mapped while a mapped one has room, and no
cached prefix is evicted while memory the budget pays for is unused.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Protocol

from kvferry.kv.pages import PageChanges

if TYPE_CHECKING:
    from kvferry.scheduler.block_pool import KVCacheBlock


class PageBudget(Protocol):
    """Grants for pages from a budget shared with other engines (kvferry.kv.shared_pool)."""

    def try_take(self, pages: int) -> bool: ...

    def give(self, pages: int) -> None: ...

    def available(self) -> int: ...


class PageTracker:
    """Pins per page, spare blocks per page, and the page changes not yet reported."""

    def __init__(self, num_pages: int, blocks_per_page: int):
        self.blocks_per_page = blocks_per_page
        self.pins = [0] * num_pages
        self.spare: list[dict[int, KVCacheBlock]] = [{} for _ in range(num_pages)]
        self.num_spare = 0
        self.num_spare_mapped = 0  # spare blocks in mapped pages: handed out at no cost
        self._partial: dict[int, None] = {}  # mapped pages with spare blocks (ordered set)
        self._unmapped: list[int] = []  # heap of pages with spare blocks and no pin (lazy)
        self._reported: list[bool] | None = None  # None: nothing reported yet (full sync next)
        self._dirty: set[int] = set()
        self.pages_mapped_total = 0  # pages the workers were told to map, since start (metrics)
        self.pages_returned_total = 0  # ... and to return

    @property
    def num_mapped(self) -> int:
        return sum(1 for pins in self.pins if pins)

    @property
    def num_reported_mapped(self) -> int:
        """Pages the workers hold now: mapped as of the last changes taken."""
        return 0 if self._reported is None else sum(self._reported)

    def page_of(self, block: KVCacheBlock) -> int:
        return block.block_id // self.blocks_per_page

    def is_mapped(self, page: int) -> bool:
        return self.pins[page] > 0

    # ---- pins ---------------------------------------------------------------------------

    def pin(self, block: KVCacheBlock) -> bool:
        """One more block pins its page. True when the page must be newly committed (it was
        neither pinned nor still held by the workers): a shared pool's grant is due."""
        page = self.page_of(block)
        self.pins[page] += 1
        if self.pins[page] > 1:
            return False
        self._dirty.add(page)
        self.num_spare_mapped += len(self.spare[page])
        if self.spare[page]:
            self._partial[page] = None
        return not self._workers_hold(page)

    def unpin(self, block: KVCacheBlock) -> bool:
        """One block less pins its page. True when the page is free and the workers never
        held it (its grant goes back now; otherwise when the workers learn the page is gone)."""
        page = self.page_of(block)
        assert self.pins[page] > 0, f"page {page} of {block} is not pinned"
        self.pins[page] -= 1
        if self.pins[page]:
            return False
        self._dirty.add(page)
        self.num_spare_mapped -= len(self.spare[page])
        self._partial.pop(page, None)
        heapq.heappush(self._unmapped, page)
        return not self._workers_hold(page)

    def _workers_hold(self, page: int) -> bool:
        return self._reported is not None and self._reported[page]

    # ---- spare blocks -------------------------------------------------------------------

    def add_spare(self, block: KVCacheBlock) -> None:
        page = self.page_of(block)
        assert block.block_id not in self.spare[page], f"{block} is already spare"
        self.spare[page][block.block_id] = block
        self.num_spare += 1
        if self.pins[page]:
            self.num_spare_mapped += 1
            self._partial[page] = None
        elif len(self.spare[page]) == 1:
            heapq.heappush(self._unmapped, page)

    def take_spare(self, block: KVCacheBlock) -> None:
        page = self.page_of(block)
        del self.spare[page][block.block_id]
        self.num_spare -= 1
        if self.pins[page]:
            self.num_spare_mapped -= 1
        if not self.spare[page]:
            self._partial.pop(page, None)

    def is_spare(self, block: KVCacheBlock) -> bool:
        return block.block_id in self.spare[self.page_of(block)]

    def pick(self) -> KVCacheBlock | None:
        """The spare block to hand out next: in a mapped page if any, else in the lowest
        unmapped page; None when no block is spare."""
        return self.pick_mapped() or self.pick_unmapped()

    def pick_mapped(self) -> KVCacheBlock | None:
        """A spare block of a mapped page (no memory to commit), or None."""
        if not self._partial:
            return None
        page = next(iter(self._partial))
        return next(iter(self.spare[page].values()))

    def pick_unmapped(self) -> KVCacheBlock | None:
        """A spare block of the lowest unmapped page, or None."""
        while self._unmapped:
            page = self._unmapped[0]
            if not self.pins[page] and self.spare[page]:
                return next(iter(self.spare[page].values()))
            heapq.heappop(self._unmapped)  # stale: mapped or emptied since it was pushed
        return None

    # ---- what the workers learn ---------------------------------------------------------

    def has_changes(self) -> bool:
        if self._reported is None:
            return True
        return any(bool(self.pins[p]) != self._reported[p] for p in self._dirty)

    def take_changes(self) -> PageChanges:
        """Pages mapped and returned since the last call (the first call: a full sync)."""
        if self._reported is None:
            self._reported = [bool(p) for p in self.pins]
            self._dirty.clear()
            held = tuple(p for p, pinned in enumerate(self._reported) if pinned)
            self.pages_mapped_total += len(held)
            return PageChanges(mapped=held, full_sync=True)
        mapped: list[int] = []
        unmapped: list[int] = []
        for page in sorted(self._dirty):
            now = bool(self.pins[page])
            if now != self._reported[page]:
                (mapped if now else unmapped).append(page)
                self._reported[page] = now
        self._dirty.clear()
        self.pages_mapped_total += len(mapped)
        self.pages_returned_total += len(unmapped)
        return PageChanges(mapped=tuple(mapped), unmapped=tuple(unmapped))
