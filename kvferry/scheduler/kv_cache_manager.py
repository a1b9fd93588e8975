"""KVCacheManager: block tables of every request in every KV cache group, over one BlockPool."""

from __future__ import annotations

import logging
import weakref

from kvferry.kv.null_block import reserves_null_block
from kvferry.kv.pages import PageChanges
from kvferry.kv.shared_pool import PoolPageBudget, SharedKVPool
from kvferry.kv.spec import KVCacheConfig, KVCacheSpec, SlidingWindowSpec
from kvferry.kv.usage import KVGroupStats, KVMemoryStats
from kvferry.messages.scheduler_output import BlockIds
from kvferry.scheduler.block_pool import BlockPool, KVCacheBlock
from kvferry.scheduler.hashing import BlockHasher
from kvferry.scheduler.kv_events import KVEventRecorder, KVEventsList
from kvferry.scheduler.request import Request
from kvferry.scheduler.single_type_manager import SingleTypeManager, make_manager

logger = logging.getLogger(__name__)

# One list of blocks per KV cache group.
KVCacheBlocks = tuple[list[KVCacheBlock], ...]


class KVCacheManager:
    """Allocates, caches and frees blocks for requests, one SingleTypeManager per group.

    A prefix hit has the same length (in blocks) in every group. A block enters the prefix
    cache once it is full of computed tokens (`cache_blocks`).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        enable_prefix_caching: bool,
        block_hasher: BlockHasher | None = None,
        kv_events_medium: str | None = None,
    ):
        """`kv_events_medium` ("GPU", "CPU"): record KV events (take_events), for the first
        full-attention group (the one whose cached blocks a whole prefix needs)."""
        if not kv_cache_config.groups:
            raise ValueError("KVCacheConfig has no KV cache groups")
        self.config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.enable_caching = enable_prefix_caching
        if block_hasher is None and enable_prefix_caching:
            block_hasher = BlockHasher(self.block_size)
        assert block_hasher is None or block_hasher.block_size == self.block_size
        self.block_hasher = block_hasher
        recorder = None if kv_events_medium is None else KVEventRecorder(self.block_size, kv_events_medium)
        self.pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_prefix_caching,
            reserve_null_block=reserves_null_block(kv_cache_config.has_sliding_window),
            blocks_per_page=kv_cache_config.blocks_per_page if kv_cache_config.is_elastic else None,
            page_budget=self._page_budget(kv_cache_config),
            events=recorder,
            event_group=_event_group(kv_cache_config),
        )
        self.managers: list[SingleTypeManager] = [
            make_manager(group.spec, self.pool, gid, block_hasher)
            for gid, group in enumerate(kv_cache_config.groups)
        ]

    def _page_budget(self, config: KVCacheConfig) -> PoolPageBudget | None:
        """The shared pool's grants, when the engine draws pages from one."""
        if config.memory_pool is None:
            return None
        pool = SharedKVPool(config.memory_pool)
        weakref.finalize(self, pool.close)  # a dropped engine leaves the pool
        return PoolPageBudget(pool, config.pool_page_bytes)

    def close(self) -> None:
        """Leave the shared KV memory pool, if any (an engine that exits leaves it anyway)."""
        if isinstance(self.pool.budget, PoolPageBudget):
            self.pool.budget.pool.close()
            self.pool.budget = None

    def memory_stats(self) -> KVMemoryStats:
        """KV memory reserved and committed (all ranks), and the shared pool's share."""
        page_bytes = self.config.pool_page_bytes
        pages = self.pool.pages
        mapped = self.config.num_pages if pages is None else pages.num_reported_mapped
        budget = self.pool.budget
        pool = budget.pool if isinstance(budget, PoolPageBudget) else None
        return KVMemoryStats(
            reserved_bytes=self.config.num_pages * page_bytes,
            committed_bytes=mapped * page_bytes,
            pages_mapped=mapped,
            pages_mapped_total=mapped if pages is None else pages.pages_mapped_total,
            pages_returned_total=0 if pages is None else pages.pages_returned_total,
            pool_size_bytes=0 if pool is None else pool.size_bytes,
            pool_used_bytes=0 if pool is None else pool.used_bytes(),
            pool_held_bytes=0 if pool is None else pool.held_bytes(),
        )

    def group_stats(self) -> tuple[KVGroupStats, ...]:
        """Per group: blocks and bytes in use now, blocks saved by window clipping so far.
        A block id takes its slot in every tensor whichever group holds it (hybrid
        allocation), so every group's block costs the same bytes."""
        block_bytes = self.config.pool_page_bytes // self.config.blocks_per_page
        return tuple(
            KVGroupStats(
                group=gid,
                kind=_group_kind(group.spec),
                num_layers=len(group.layer_names),
                blocks_in_use=(in_use := manager.num_blocks_in_use),
                bytes_in_use=in_use * block_bytes,
                blocks_clipped_total=manager.num_blocks_clipped,
            )
            for gid, (group, manager) in enumerate(zip(self.config.groups, self.managers, strict=True))
        )

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def num_blocks(self) -> int:
        """Blocks the scheduler may hand out (the reserved null block excluded)."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def empty_blocks(self) -> KVCacheBlocks:
        return tuple([] for _ in self.managers)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens fits in the whole pool at all."""
        return sum(m.max_blocks_needed(num_tokens) for m in self.managers) <= self.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of the request, as blocks per group and a token count.

        Never the whole request: its last token is always left to compute, so the model
        produces logits for it. Hits are not referenced yet: pass them to allocate_slots
        before allocating anything else.
        """
        wants_prompt_logprobs = request.sampling_params.prompt_logprobs is not None  # every position computed
        if not self.enable_caching or self.block_hasher is None or wants_prompt_logprobs:
            return self.empty_blocks(), 0
        num_blocks = (request.num_tokens - 1) // self.block_size
        while True:
            hits = tuple(m.find_longest_cache_hit(request, num_blocks) for m in self.managers)
            shortest = min(len(h) for h in hits)
            if all(len(h) == shortest for h in hits):
                return hits, shortest * self.block_size
            num_blocks = shortest

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> BlockIds | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` are prefix hits from get_computed_blocks (for a request that
        holds no blocks yet); their tokens count as computed, after request.num_computed_tokens.
        Returns the ids of the newly allocated blocks per group, or None, changing nothing,
        when the pool has too few free blocks.
        """
        computed = new_computed_blocks if new_computed_blocks is not None else self.empty_blocks()
        assert len(computed) == self.num_groups
        num_hit_tokens = len(computed[0]) * self.block_size
        num_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        req_id = request.req_id
        for manager in self.managers:
            manager.remove_skipped_blocks(req_id, request.num_computed_tokens)
        needed = sum(
            m.num_blocks_to_allocate(req_id, num_tokens, blocks)
            for m, blocks in zip(self.managers, computed, strict=True)
        )
        if not self.pool.can_allocate(needed):
            return None
        for manager, blocks in zip(self.managers, computed, strict=True):
            manager.save_new_computed_blocks(req_id, blocks)
        new_blocks = [m.allocate_new_blocks(req_id, num_tokens) for m in self.managers]
        self.pool.settle()
        return tuple([b.block_id for b in blocks] for blocks in new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full of computed tokens in the prefix cache."""
        for manager in self.managers:
            manager.cache_blocks(request, num_computed_tokens)

    def cache_loaded_blocks(self, request: Request) -> None:
        """Register a request's blocks once a connector loaded its computed tokens. A load
        fills, of each sliding group, only the blocks the next token sees (kvferry.kv.window);
        the group first lets go of the earlier ones it holds, unfilled, so none of them is
        ever offered as a prefix hit."""
        for manager in self.managers:
            manager.remove_skipped_blocks(request.req_id, request.num_computed_tokens)
        self.cache_blocks(request, request.num_computed_tokens)

    def free(self, request: Request | str) -> None:
        req_id = request if isinstance(request, str) else request.req_id
        for manager in self.managers:
            manager.free(req_id)
        if self.pool.budget is not None and self.pool.num_used_blocks == 0:
            # On a shared pool an idle engine keeps nothing: its cached prefixes' pages go
            # back, so a busy engine can grow (the next step tells the workers).
            self.pool.reset_prefix_cache()

    def get_blocks(self, req_id: str) -> KVCacheBlocks:
        return tuple(list(m.blocks(req_id)) for m in self.managers)

    def get_block_ids(self, req_id: str) -> BlockIds:
        return tuple([b.block_id for b in m.blocks(req_id)] for m in self.managers)

    def holds_blocks(self, req_id: str) -> bool:
        return any(m.blocks(req_id) for m in self.managers)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_page_changes(self) -> PageChanges | None:
        """Elastic KV memory: the pages the workers map or return before the next step."""
        return self.pool.take_page_changes()

    def has_page_changes(self) -> bool:
        return self.pool.has_page_changes()

    def take_events(self) -> KVEventsList:
        """The prefix cache's changes since the last call (none unless recording)."""
        return [] if self.pool.events is None else self.pool.events.take()


def _event_group(config: KVCacheConfig) -> int:
    """The group whose prefix cache the KV events describe: the first full-attention one."""
    for gid, group in enumerate(config.groups):
        if not isinstance(group.spec, SlidingWindowSpec):
            return gid
    return 0


def _group_kind(spec: KVCacheSpec) -> str:
    return f"window {spec.sliding_window}" if isinstance(spec, SlidingWindowSpec) else "full"
