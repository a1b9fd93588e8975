"""OffloadScheduler: the scheduler half's logic (index, loads, saves, failures, delayed frees).

Per step it tells the workers which tier slots to load into which device blocks (found at
admission, right after the local prefix-cache lookup), and which newly computed full
prompt blocks to save into which slots (with the demotions that make room). A request
that had saves scheduled keeps its blocks after it finishes (delay_free) until every
worker reports its saves done in `finished_sending`.

Sliding-window groups (KV cache groups of a hybrid model): a block position is saved with
every group whose block exists when the position is saved; a sliding group's block that no
window could see any more was never allocated (the null block), so the slot holds no KV of
that group there. A later hit of `h` blocks is offered only if it is usable by every group:
each sliding group's blocks that the token after the hit sees, the last
`ceil((window - 1) / block_size)` before `h` (`kvferry.kv.window.first_visible_block`), are
stored (or were in the local hit), and the scheduler will allocate them (it allocates no block of a sliding group before
`kvferry.kv.window.first_allocated_block` of the request's tokens). Loads copy the full
groups' blocks and, of each sliding group, only the blocks the window sees.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from dataclasses import dataclass

from kvferry.connector.offload.blocks import SKIP, groups_present
from kvferry.connector.offload.config import (
    OffloadConfig,
    check_kv_cache_config,
    instance_block_bytes,
    slot_bytes_per_rank,
)
from kvferry.connector.offload.index import TierIndex
from kvferry.connector.offload.metadata import LoadOp, OffloadMetadata, SaveFailed, SaveOp, Tier
from kvferry.kv.null_block import null_block_id
from kvferry.kv.spec import KVCacheConfig, SlidingWindowSpec
from kvferry.kv.window import first_allocated_block, first_visible_block
from kvferry.messages.kv_connector import KVConnectorOutput
from kvferry.messages.scheduler_output import BlockIds, SchedulerOutput
from kvferry.scheduler.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Window:
    group: int
    window: int  # tokens


@dataclass
class _Tracked:
    """A request the workers hold blocks for: its block table and how far saves got."""

    request: Request
    block_ids: list[list[int]]  # per KV cache group
    next_block: int = 0  # prompt blocks before this one were saved or found stored


class OffloadScheduler:
    def __init__(
        self, config: OffloadConfig, kv_cache_config: KVCacheConfig, total_kv_heads: int, tp_size: int
    ):
        check_kv_cache_config(kv_cache_config)
        self.config = config
        self.block_size = kv_cache_config.block_size
        self.slot_bytes = slot_bytes_per_rank(kv_cache_config)  # rank 0's (the scheduler's view)
        self.block_bytes = instance_block_bytes(kv_cache_config, total_kv_heads, tp_size)
        dram, disk = config.num_slots(self.block_bytes)
        self.index = TierIndex(dram, disk)
        self.null_id = null_block_id(kv_cache_config.has_sliding_window)
        self.windows = [
            _Window(gid, g.spec.sliding_window)
            for gid, g in enumerate(kv_cache_config.groups)
            if isinstance(g.spec, SlidingWindowSpec)
        ]
        self.instance_id = uuid.uuid4().hex
        self._reqs: dict[str, _Tracked] = {}
        self._local_hits: dict[str, int] = {}  # req -> local prefix hit of its last lookup
        self._has_saves: set[str] = set()  # requests whose blocks saves may still read
        self._pending_loads: list[LoadOp] = []  # for the metadata being built this step
        self._step_loads: list[LoadOp] = []  # sent in the last metadata
        self._step_saves: dict[str, list[SaveOp]] = {}
        self._epoch = 0
        self.counters: Counter[str] = Counter()  # decisions taken here (per connector instance)
        self.totals: Counter[str] = Counter()  # worker stats summed over the engine's life
        logger.info(
            "offload tiers: %d DRAM + %d disk slots; a block takes %d bytes over %d rank(s)",
            dram,
            disk,
            self.block_bytes,
            tp_size,
        )

    # ---- admission ------------------------------------------------------------------

    def num_matched(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens in stored blocks right after the local hit, whole blocks, never the last
        token; the longest such hit that every sliding-window group can use."""
        self._local_hits[request.req_id] = num_computed_tokens
        start = num_computed_tokens // self.block_size
        stop = (request.num_tokens - 1) // self.block_size
        end = start + self.index.count_prefix(request.block_hashes, start, stop)
        # A shorter hit leaves more new tokens: never allocated further back, so stop there.
        while end > start and self._allocated(request, end) and not self._stored(request, start, end):
            end -= 1
        return (end - start) * self.block_size if end > start and self._allocated(request, end) else 0

    def _allocated(self, request: Request, end: int) -> bool:
        """Whether the scheduler allocates, in each sliding group, the blocks that the token
        after a hit ending at block `end` sees (it gives the prompt's tail only: a hit followed
        by more than about a window of new tokens would leave them null)."""
        num_tokens = request.num_tokens
        return all(
            first_allocated_block(w.window, self.block_size, num_tokens) <= self._first_seen(w, end)
            for w in self.windows
        )

    def _stored(self, request: Request, start: int, end: int) -> bool:
        """Whether each sliding group's blocks that the token after the hit sees are stored
        (those before `start` are the local hit's)."""
        for w in self.windows:
            for i in range(max(start, self._first_seen(w, end)), end):
                if w.group not in self.index.groups_of(request.block_hashes[i]):
                    return False
        return True

    def _first_seen(self, w: _Window, end: int) -> int:
        """The first block the token after a hit ending at block `end` sees."""
        return first_visible_block(w.window, self.block_size, end * self.block_size)

    def after_alloc(self, request: Request, block_ids: BlockIds, num_external: int) -> None:
        tracked = _Tracked(request, [list(ids) for ids in block_ids])
        self._reqs[request.req_id] = tracked
        local = self._local_hits.pop(request.req_id, 0)
        if num_external <= 0:
            return
        assert local % self.block_size == 0, "local prefix hits are whole blocks"
        start = local // self.block_size
        # Whole blocks: a block cut short by the scheduler is loaded whole (the rest is recomputed).
        for i in range(start, start + -(-num_external // self.block_size)):
            block_hash = request.block_hashes[i]
            entry = self.index.touch(block_hash)
            assert entry is not None, "a matched block left the index before allocation"
            ids = self._ids_at(tracked, i)  # a sliding group's unseen blocks are null: skipped
            load = LoadOp(request.req_id, entry.tier, entry.slot, block_hash, entry.epoch, ids, entry.groups)
            self._pending_loads.append(load)
            self.counters["loads_dram" if entry.tier is Tier.DRAM else "loads_disk"] += 1

    # ---- per step ---------------------------------------------------------------------

    def build_meta(self, so: SchedulerOutput) -> OffloadMetadata:
        meta = OffloadMetadata(instance_id=self.instance_id, idle=so.is_empty)
        meta.loads, self._pending_loads = self._pending_loads, []
        # A preempted request keeps its (stale) entry until admission replaces it.
        meta.preempted = sorted(so.preempted_req_ids & self._has_saves)
        self._update_block_tables(so)
        self._step_saves = {}
        dropped = self.index.num_dropped
        for req_id in so.num_scheduled_tokens:
            tracked = self._reqs.get(req_id)
            if tracked is not None:
                self._schedule_saves(tracked, meta)
        meta.num_evicted = self.index.num_dropped - dropped
        self._step_loads = meta.loads
        return meta

    def _update_block_tables(self, so: SchedulerOutput) -> None:
        for new in so.scheduled_new_reqs:
            tracked = self._reqs.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = [list(ids) for ids in new.block_ids]
        cached = so.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            tracked = self._reqs.get(req_id)
            if tracked is not None and new_ids is not None:
                for group, added in zip(tracked.block_ids, new_ids, strict=True):
                    group.extend(added)

    def _schedule_saves(self, tracked: _Tracked, meta: OffloadMetadata) -> None:
        """Saves for the prompt blocks this step fills (num_computed_tokens already advanced)."""
        request = tracked.request
        full = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        for i in range(tracked.next_block, full):
            block_hash = request.block_hashes[i]
            ids = self._ids_at(tracked, i)
            groups = groups_present(ids)
            stored = self.index.touch(block_hash)
            if stored is not None:
                if groups <= stored.groups or not stored.groups <= groups:
                    continue  # stored already (or being saved) with what we have: not again
                self.index.remove(block_hash)  # stored with fewer groups: saved again with more
            self._epoch += 1
            entry, demotions = self.index.insert(block_hash, self._epoch, groups)
            meta.ops.extend(demotions)
            save = SaveOp(request.req_id, entry.tier, entry.slot, block_hash, entry.epoch, ids)
            meta.ops.append(save)
            self._step_saves.setdefault(request.req_id, []).append(save)
            self._has_saves.add(request.req_id)
            self.counters["saves"] += 1
        tracked.next_block = max(tracked.next_block, full)

    def _ids_at(self, tracked: _Tracked, index: int) -> tuple[int, ...]:
        """The request's block at position `index` in every group, SKIP where it is null."""
        return tuple(SKIP if (b := group[index]) == self.null_id else b for group in tracked.block_ids)

    # ---- results ----------------------------------------------------------------------

    def update_output(self, output: KVConnectorOutput) -> None:
        if output.stats is not None:
            self.totals.update(output.stats.data)
        for event in output.events:
            if isinstance(event, SaveFailed) and event.instance_id == self.instance_id:
                if self.index.remove(event.block_hash, event.epoch):
                    logger.warning("offload: a save failed; block dropped from the index")
        if output.invalid_block_ids:
            self._forget_failed_loads(set(output.invalid_block_ids))

    def _forget_failed_loads(self, invalid: set[int]) -> None:
        """Drop what failed loads read, and what the step saved for requests with invalid blocks
        (computed over missing KV; another connector may have done the failed load)."""
        for load in self._step_loads:
            if invalid.intersection(load.block_ids) and self.index.remove(load.block_hash, load.epoch):
                self.counters["load_failures"] += 1
        for req_id, saves in self._step_saves.items():
            tracked = self._reqs.get(req_id)
            if tracked is None or any(invalid.intersection(ids) for ids in tracked.block_ids):
                for save in saves:
                    self.index.remove(save.block_hash, save.epoch)
        logger.warning("offload: %d block(s) failed to load; dependent entries dropped", len(invalid))

    def finished(self, request: Request) -> bool:
        """delay_free: whether saves scheduled for the request may still read its blocks."""
        self._reqs.pop(request.req_id, None)
        self._local_hits.pop(request.req_id, None)
        if request.req_id in self._has_saves:
            self._has_saves.discard(request.req_id)
            return True
        return False
