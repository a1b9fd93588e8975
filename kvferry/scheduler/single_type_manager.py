"""Per-group block bookkeeping: one manager per KV cache group, all sharing one BlockPool.

A manager holds each request's block table for its group and knows the group's attention
type: how many blocks a token count needs, which cached blocks make a usable prefix hit,
and which blocks can be dropped as the request advances (sliding window).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvferry.kv.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvferry.kv.window import first_allocated_block, first_visible_block
from kvferry.scheduler.block_pool import BlockPool, KVCacheBlock
from kvferry.scheduler.hashing import BlockHasher
from kvferry.scheduler.request import Request

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeManager(ABC):
    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, hasher: BlockHasher | None):
        self.spec = spec
        self.pool = pool
        self.group_id = group_id
        self.hasher = hasher
        self.block_size = spec.block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already registered in the cache
        # Table entries a full-attention group would have held and this one does not (window
        # clipping): never allocated, or freed while their request ran. Since start (metrics).
        self.num_blocks_clipped = 0

    @property
    def num_blocks_in_use(self) -> int:
        """Distinct blocks the group's requests hold now (the null block excluded)."""
        return len({b.block_id for table in self.req_to_blocks.values() for b in table if not b.is_null})

    def blocks(self, req_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(req_id, [])

    def num_blocks_to_allocate(
        self, req_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free-queue blocks an allocation for `num_tokens` would consume.

        Cache hits that sit in the free queue count too: touching them takes them out.
        """
        held = len(self.req_to_blocks.get(req_id, ()))
        num_new = max(0, cdiv(num_tokens, self.block_size) - len(new_computed_blocks) - held)
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable

    def save_new_computed_blocks(self, req_id: str, blocks: Sequence[KVCacheBlock]) -> None:
        if not blocks:
            return
        held = self.req_to_blocks.setdefault(req_id, [])
        assert not held, "prefix hits are only added to a request that holds no blocks"
        self.pool.touch(blocks)
        held.extend(blocks)
        self.num_cached_blocks[req_id] = len(blocks)

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[KVCacheBlock]:
        held = self.req_to_blocks.setdefault(req_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(held)
        if num_new <= 0:
            return []
        new_blocks = self.pool.get_new_blocks(num_new)
        held.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full of computed tokens."""
        if self.hasher is None or not self.pool.enable_caching:
            return
        req_id = request.req_id
        held = self.req_to_blocks.get(req_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(held))
        start = self.num_cached_blocks.get(req_id, 0)
        if num_full <= start:
            return
        indices = [i for i in range(start, num_full) if not held[i].is_null]
        self.pool.cache_full_blocks(
            [held[i] for i in indices],
            [request.block_hashes[i] for i in indices],
            [self.hasher.content(request, i) for i in indices],
            self.group_id,
        )
        self.num_cached_blocks[req_id] = num_full

    def free(self, req_id: str) -> None:
        """Release the request's blocks, last block first (the tail is evicted first)."""
        blocks = self.req_to_blocks.pop(req_id, [])
        self.num_cached_blocks.pop(req_id, None)
        self.pool.free_blocks(reversed(blocks))

    def cached_block(self, request: Request, index: int) -> KVCacheBlock | None:
        assert self.hasher is not None
        content = self.hasher.content(request, index)
        return self.pool.get_cached_block(request.block_hashes[index], content, self.group_id)

    @abstractmethod
    def find_longest_cache_hit(self, request: Request, max_num_blocks: int) -> list[KVCacheBlock]:
        """Cached blocks for the longest usable prefix of at most `max_num_blocks` blocks."""

    @abstractmethod
    def max_blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of `num_tokens` tokens needs at once (to reject impossible ones)."""

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Free blocks no future token attends to (none for full attention)."""


class FullAttentionManager(SingleTypeManager):
    def find_longest_cache_hit(self, request: Request, max_num_blocks: int) -> list[KVCacheBlock]:
        hits: list[KVCacheBlock] = []
        for index in range(min(max_num_blocks, len(request.block_hashes))):
            block = self.cached_block(request, index)
            if block is None:
                break
            hits.append(block)
        return hits

    def max_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)


class SlidingWindowManager(SingleTypeManager):
    """Each token attends to the last `sliding_window` positions; older blocks become null.

    A block is only ever allocated for positions a later token (or a prefix hit at the
    step's last block boundary) can see: earlier positions of a step's chunk get the null
    block (their KV is written there and never read: attention takes a chunk's own keys
    from the step, not from the cache). So a request holds about two windows' worth of
    blocks, however long its prompt chunks.
    """

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, hasher: BlockHasher | None):
        super().__init__(spec, pool, group_id, hasher)
        assert isinstance(spec, SlidingWindowSpec) and spec.sliding_window > 0
        assert pool.null_block is not None, "sliding window groups need the pool's null block"
        self.window = spec.sliding_window
        self.null_block = pool.null_block
        # Cached blocks that must precede the first computed token for a hit to be usable.
        self.num_window_blocks = cdiv(self.window - 1, self.block_size)
        self.num_skipped: dict[str, int] = {}  # leading table entries already null

    def find_longest_cache_hit(self, request: Request, max_num_blocks: int) -> list[KVCacheBlock]:
        limit = min(max_num_blocks, len(request.block_hashes))
        hits = [self.null_block] * limit
        run = 0
        for index in range(limit - 1, -1, -1):
            block = self.cached_block(request, index)
            if block is None:
                run = 0
                continue
            hits[index] = block
            run += 1
            if run >= self.num_window_blocks:
                return hits[: index + run]
        return hits[:run]  # a run starting at block 0 is usable whatever its length

    def max_blocks_needed(self, num_tokens: int) -> int:
        """The window its context needs, and the window a step's new tokens leave behind."""
        return min(cdiv(num_tokens, self.block_size), 2 * self.num_window_blocks + 3)

    def _first_real_block(self, num_tokens: int) -> int:
        """The first block that a token after the first `num_tokens`, or a prefix hit at the
        last block boundary before the last of them (the same prompt again), can see."""
        return first_allocated_block(self.window, self.block_size, num_tokens)

    def num_blocks_to_allocate(
        self, req_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        held = len(self.req_to_blocks.get(req_id, ())) + len(new_computed_blocks)
        start = max(held, self._first_real_block(num_tokens))
        num_new = max(0, cdiv(num_tokens, self.block_size) - start)
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new + num_evictable

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """New table entries up to `num_tokens`: null ones for positions no later token sees."""
        held = self.req_to_blocks.setdefault(req_id, [])
        total = cdiv(num_tokens, self.block_size)
        if total <= len(held):
            return []
        start = max(len(held), self._first_real_block(num_tokens))
        new_blocks = [self.null_block] * (start - len(held)) + self.pool.get_new_blocks(total - start)
        self.num_blocks_clipped += start - len(held)
        held.extend(new_blocks)
        return new_blocks

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Free the blocks before the first one the next token sees (tail first). Entries
        past the last freed one may be null too (chunk positions never allocated)."""
        held = self.req_to_blocks.get(req_id)
        if not held:
            return
        start = self.num_skipped.get(req_id, 0)
        first_needed = min(first_visible_block(self.window, self.block_size, num_computed_tokens), len(held))
        if first_needed <= start:
            return
        dropped = [held[i] for i in range(start, first_needed) if not held[i].is_null]
        held[start:first_needed] = [self.null_block] * (first_needed - start)
        self.num_skipped[req_id] = first_needed
        self.num_blocks_clipped += len(dropped)
        self.pool.free_blocks(reversed(dropped))

    def free(self, req_id: str) -> None:
        self.num_skipped.pop(req_id, None)
        super().free(req_id)


def make_manager(
    spec: KVCacheSpec, pool: BlockPool, group_id: int, hasher: BlockHasher | None
) -> SingleTypeManager:
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, pool, group_id, hasher)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, pool, group_id, hasher)
    raise TypeError(f"no KV cache manager for {type(spec).__name__}")
