"""The block pool: every KV block of every group, reference counts, LRU free queue, prefix cache.

Free blocks wait in a doubly linked queue: new blocks are taken from the head, freed blocks
join the tail. A freed block keeps its hash (it stays a prefix-cache hit) until it is taken
for reuse, so cached blocks are evicted least recently freed first. A hit on a free block
pulls it out of the middle of the queue in O(1).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

from kvferry.errors import ConfigError
from kvferry.kv.null_block import NULL_BLOCK_ID
from kvferry.kv.pages import PageChanges
from kvferry.scheduler.hashing import BlockContent, BlockHash
from kvferry.scheduler.kv_events import KVEventRecorder
from kvferry.scheduler.page_tracker import PageBudget, PageTracker

logger = logging.getLogger(__name__)

# A cached block is found by its hash and the KV cache group it belongs to.
CacheKey = tuple[BlockHash, int]


class KVCacheBlock:
    """One physical block. Holds no KV itself: the id indexes the workers' KV tensors."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "content",
        "group_id",
        "is_null",
        "prev_free",
        "next_free",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while the block is in the prefix cache
        self.content: BlockContent | None = None  # what the hash stands for (collision check)
        self.group_id = -1
        self.is_null = False  # the reserved placeholder block (sliding window gaps)
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    @property
    def cache_key(self) -> CacheKey | None:
        return None if self.block_hash is None else (self.block_hash, self.group_id)

    def reset_hash(self) -> None:
        self.block_hash = None
        self.content = None
        self.group_id = -1

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: O(1) pop, append and removal."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not None
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """All blocks, shared by every KV cache group.

    `num_blocks` counts blocks that can be handed out; with `reserve_null_block` block 0 is
    kept aside as a placeholder for table entries that need no KV (sliding-window gaps).
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        reserve_null_block: bool = False,
        blocks_per_page: int | None = None,
        page_budget: PageBudget | None = None,
        events: KVEventRecorder | None = None,
        event_group: int = 0,
    ):
        """`events`: records the prefix cache's changes of group `event_group` (KV events).
        `blocks_per_page` (elastic KV memory): allocation is page-aware and the pool
        reports which pages hold blocks (kvferry.scheduler.page_tracker); None: eager.
        `page_budget`: pages come from a pool shared with other engines; a new page needs
        its grant, and the engine evicts its own cached prefixes before asking for one."""
        if num_blocks <= int(reserve_null_block):
            raise ValueError(f"a block pool needs at least one usable block, got {num_blocks}")
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock | None = None
        self.pages: PageTracker | None = None
        self.budget = page_budget if blocks_per_page is not None else None
        self._credit = 0  # pages granted by the budget, not mapped yet
        if blocks_per_page is not None:
            self.pages = PageTracker(-(-num_blocks // blocks_per_page), blocks_per_page)
        if reserve_null_block:
            self.null_block = self.blocks[NULL_BLOCK_ID]
            self.null_block.is_null = True
            if self.pages is not None:
                if self.budget is not None and not self.budget.try_take(1):
                    raise ConfigError("the shared KV memory pool has no room for this engine's first page")
                self._credit = int(self.budget is not None)
                self._pin(self.null_block)  # its page stays mapped: tables point at it
        usable = [block for block in self.blocks if not block.is_null]
        self.num_blocks = len(usable)
        # Eager: every free block, LRU. Elastic: free blocks holding a cached prefix only;
        # the spare ones (no prefix) wait in the page tracker.
        self.free_queue = FreeBlockQueue(usable if self.pages is None else ())
        if self.pages is not None:
            for block in usable:
                self.pages.add_spare(block)
        self.cached: dict[CacheKey, KVCacheBlock] = {}
        self.num_collisions = 0  # hash hits rejected because the content differed
        self.events = events
        self.event_group = event_group

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-unused ones included (on a shared
        pool: as far as the pool could grant pages for them now)."""
        if self.pages is None:
            return self.free_queue.num_free
        if self.budget is None:
            return self.free_queue.num_free + self.pages.num_spare
        unmapped = self.pages.num_spare - self.pages.num_spare_mapped
        grantable = (self._credit + self.budget.available()) * self.pages.blocks_per_page
        return self.free_queue.num_free + self.pages.num_spare_mapped + min(unmapped, grantable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests (the null block excluded)."""
        spare = 0 if self.pages is None else self.pages.num_spare
        return self.num_blocks - self.free_queue.num_free - spare

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether `num_blocks` new blocks can be handed out now; on a shared pool the pages
        they need are granted here, before any is taken (leftovers: `settle`)."""
        if self.budget is None:
            return num_blocks <= self.num_free_blocks
        pages = self.pages
        assert pages is not None  # a shared pool's budget comes with page tracking
        rest = num_blocks - self.free_queue.num_free - pages.num_spare_mapped
        if rest <= 0:
            return True
        if rest > pages.num_spare - pages.num_spare_mapped:
            return False
        per_page = pages.blocks_per_page
        partial = int(len(self.blocks) % per_page != 0)  # the last page holds fewer ids
        missing = -(-rest // per_page) + partial - self._credit
        if missing > 0:
            if not self.budget.try_take(missing):
                return False
            self._credit += missing
        return True

    def settle(self) -> None:
        """Give back grants an allocation did not use."""
        if self.budget is not None and self._credit:
            self.budget.give(self._credit)
            self._credit = 0

    def take_page_changes(self) -> PageChanges | None:
        """Pages mapped and returned since the last call; None with eager memory. On a
        shared pool a returned page's grant goes back once the workers are told."""
        if self.pages is None:
            return None
        changes = self.pages.take_changes()
        if self.budget is not None and changes.unmapped:
            self.budget.give(len(changes.unmapped))
        return changes

    def has_page_changes(self) -> bool:
        return self.pages is not None and self.pages.has_changes()

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue (evicting their cached hash), ref 1 each."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self._next_free()
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _next_free(self) -> KVCacheBlock:
        """Eager: the head of the LRU queue. Elastic: a spare block (mapped pages first),
        else the least recently freed cached block (its page stays mapped). On a shared
        pool: a spare block of a mapped page, then a cached block, then a new page."""
        if self.pages is None:
            return self.free_queue.popleft()
        spare = self.pages.pick_mapped()
        if spare is None and (self.budget is None or not self.free_queue.num_free):
            spare = self.pages.pick_unmapped()
        if spare is None:
            return self.free_queue.popleft()
        self.pages.take_spare(spare)
        self._pin(spare)
        return spare

    def _pin(self, block: KVCacheBlock) -> None:
        assert self.pages is not None  # elastic pools only
        if not self.pages.pin(block) or self.budget is None:
            return
        if self._credit:
            self._credit -= 1
        elif not self.budget.try_take(1):
            raise RuntimeError("a KV page without a grant from the shared pool (can_allocate first)")

    def _unpin(self, block: KVCacheBlock) -> None:
        assert self.pages is not None  # elastic pools only
        if self.pages.unpin(block) and self.budget is not None:
            self.budget.give(1)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the cache (pulling free ones out of the queue)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self._take_free(block)
            block.ref_cnt += 1

    def _take_free(self, block: KVCacheBlock) -> None:
        if self.pages is not None and self.pages.is_spare(block):
            self.pages.take_spare(block)
            self._pin(block)
            return
        self.free_queue.remove(block)

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the tail in the given order.

        Pass a request's blocks last-first: the tail of a prefix is then evicted first.
        """
        for block in blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._release(block)

    def _release(self, block: KVCacheBlock) -> None:
        """A block nobody holds: LRU queue if eager or cached, else spare (unpins its page)."""
        if self.pages is None or block.block_hash is not None:
            self.free_queue.append(block)
            return
        self.pages.add_spare(block)
        self._unpin(block)

    def get_cached_block(
        self, block_hash: BlockHash, content: BlockContent, group_id: int = 0
    ) -> KVCacheBlock | None:
        """The cached block for this hash in this group, if its content matches too."""
        block = self.cached.get((block_hash, group_id))
        if block is None:
            return None
        if block.content != content:
            self.num_collisions += 1
            logger.warning("block hash collision on %s: content differs, treated as a miss", block_hash.hex())
            return None
        return block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        contents: Sequence[BlockContent],
        group_id: int = 0,
    ) -> None:
        """Register full, computed blocks in the prefix cache (blocks[i] holds contents[i])."""
        assert len(blocks) == len(block_hashes) == len(contents)
        if not self.enable_caching:
            return
        stored: list[BlockHash] = []
        stored_contents: list[BlockContent] = []
        for block, block_hash, content in zip(blocks, block_hashes, contents, strict=True):
            assert not block.is_null and block.ref_cnt > 0
            if block.block_hash is not None:
                assert block.cache_key == (block_hash, group_id), f"{block} cached under another hash"
                continue
            if (block_hash, group_id) in self.cached:
                continue  # an equal block is already cached; this duplicate stays private
            block.block_hash = block_hash
            block.content = content
            block.group_id = group_id
            self.cached[(block_hash, group_id)] = block
            stored.append(block_hash)
            stored_contents.append(content)
        if self.events is not None and stored and group_id == self.event_group:
            self.events.stored(stored, stored_contents)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is in use (returns False otherwise)."""
        in_use = self.num_used_blocks
        if in_use:
            logger.warning("cannot reset the prefix cache: %d blocks are in use", in_use)
            return False
        if self.events is not None and self.cached:
            self.events.cleared()
        for block in self.cached.values():
            block.reset_hash()
            if self.pages is not None:
                self.free_queue.remove(block)
                self._release(block)
        self.cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        key = block.cache_key
        if key is None:
            return
        if self.cached.get(key) is block:
            del self.cached[key]
            if self.events is not None and key[1] == self.event_group:
                self.events.removed(key[0])
        block.reset_hash()
