"""OffloadWorker: the worker half's logic (tiers, loads before the forward, background saves).

Loads run synchronously in start_load_kv, before the forward: each waits only for the
background jobs that touch its slots. Saves and demotions of a step run as one background
job submitted after the forward (wait_for_save), so the forward never waits for them;
the scheduler keeps the request's device blocks until this worker reports the request in
finished_sending. With tensor parallelism every rank runs this on its own KV-head slice;
block counts are reported by rank 0 only, byte counts by every rank (their sum is the total).
A KV head replicated on several ranks (fewer KV heads than ranks; a latent-attention
cache) is stored once: only its owner rank (`tier_owner`, the lowest holding it) has tiers
and saves; on a load the owner reads its slot and broadcasts the rows and their check
results to its replicas over the tensor-parallel group (all ranks run the same loads in
the same step), so every rank fills its blocks, or reports the same load errors.

Sliding-window groups: a load or save moves only the groups whose block id is not SKIP (a
load: the groups the window sees; bytes count those alone). A sliding group's block is
freed while its request runs, once it left the window, and may be handed to another
request by the next step: so a step whose saves read sliding blocks is waited for before
the next step loads or runs its forward.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

import torch

from kvferry.connector.offload.blocks import SKIP, BlockCopier, Staging, groups_present
from kvferry.connector.offload.config import (
    OffloadConfig,
    check_kv_cache_config,
    instance_block_bytes,
    slot_bytes_per_rank,
    tier_owner,
    tier_owners,
)
from kvferry.connector.offload.jobs import JobQueue
from kvferry.connector.offload.layerwise import LayerLoader, LayerPlan, StagedSaves
from kvferry.connector.offload.metadata import DemoteOp, LoadOp, OffloadMetadata, SaveFailed, SaveOp, Tier
from kvferry.connector.offload.tiers import DiskTier, DramTier, Tag, payload_crc
from kvferry.kv.spec import KVCacheConfig, SlidingWindowSpec

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.02  # an empty step waits this long for pending saves (no hot spin)


class OffloadWorker:
    def __init__(
        self,
        config: OffloadConfig,
        kv_cache_config: KVCacheConfig,
        total_kv_heads: int,
        tp_size: int,
        rank: int,
    ):
        check_kv_cache_config(kv_cache_config)
        self.rank = rank
        self.owner = tier_owner(rank, tp_size, total_kv_heads)  # whose tiers hold my heads
        self.owns = self.owner == rank  # False: a replica, saves nothing, has no tiers
        # Owners broadcasting loads to replicas (none when no head is replicated).
        self._broadcasters = tier_owners(tp_size, total_kv_heads) if total_kv_heads < tp_size else []
        self.verify = config.verify_checksum
        self.layerwise = config.layerwise
        self.loader: LayerLoader | None = None  # layer-wise loads (built at registration)
        self.plan: LayerPlan | None = None
        self._staged: StagedSaves | None = None  # this step's saves copied layer by layer
        self.slot_bytes = slot_bytes_per_rank(kv_cache_config)  # this rank's KV heads only
        self._stage_rows = Staging(self.slot_bytes)  # taken on the main thread, filled in order
        dram_slots, disk_slots = config.num_slots(
            instance_block_bytes(kv_cache_config, total_kv_heads, tp_size)
        )
        self._dram_slots = dram_slots if self.owns else 0
        self.dram: DramTier | None = None  # allocated at registration (pinned for CUDA KV)
        disk_dir = config.disk_dir
        has_disk = self.owns and disk_slots and disk_dir
        self.disk = DiskTier(disk_dir, disk_slots, self.slot_bytes, rank) if has_disk and disk_dir else None
        self.copier: BlockCopier | None = None
        # Grow-only staging rows, one per thread (remade pinned at registration for CUDA KV).
        self._load_rows = Staging(self.slot_bytes)  # main thread
        self._save_rows = Staging(self.slot_bytes)  # background thread
        self.jobs = JobQueue(f"kvferry-offload-rank{rank}")
        self._pending_loads: list[LoadOp] = []  # the layer-wise loads in flight
        self._slot_seq: dict[tuple[Tier, int], int] = {}  # last job touching a slot
        self._req_seq: dict[str, int] = {}  # last job saving a request's blocks
        self._sliding = frozenset(
            gid for gid, g in enumerate(kv_cache_config.groups) if isinstance(g.spec, SlidingWindowSpec)
        )
        self._window_seq = 0  # last job reading sliding-window blocks (freed while running)
        self._elastic = kv_cache_config.is_elastic
        self._awaiting: set[str] = set()  # finished, saves still running
        self._failed_reqs: set[str] = set()  # loads failed this step: their saves are skipped
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()  # guards the counters and events (both threads)
        self._stats: Counter[str] = Counter()
        self._events: list[object] = []

    def register(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> None:
        self.copier = BlockCopier(kv_caches, kv_cache_config)
        assert self.copier.slot_bytes == self.slot_bytes, "slot size differs from the KV cache config"
        pin = self.copier.device.type == "cuda"
        if self._dram_slots:
            self.dram = DramTier(self._dram_slots, self.slot_bytes, pin_memory=pin)
        self._load_rows = Staging(self.slot_bytes, pin)  # main thread (layer-wise: the loader)
        self._save_rows = Staging(self.slot_bytes, pin)  # background thread
        self._stage_rows = Staging(self.slot_bytes, pin)
        if self.layerwise:
            self.plan = LayerPlan.build(self.copier, list(kv_caches))
            # Replicated heads are broadcast by their owner, with every rank in step: whole loads.
            if not self._broadcasters:
                self.loader = LayerLoader(self.plan, f"kvferry-offload-load-rank{self.rank}")

    # ---- before the forward -------------------------------------------------------------

    def start_load(self, meta: OffloadMetadata) -> None:
        self.finish_loads()  # a step whose forward never waited for its layers
        for req_id in meta.preempted:  # their blocks may be reused by this very step
            seq = self._req_seq.get(req_id)
            if seq is not None:
                self.jobs.wait(seq)
        if self._window_seq:  # sliding blocks may have left their window and be reused now
            self.jobs.wait(self._window_seq)
            self._window_seq = 0
        self._failed_reqs = set()
        if not meta.loads:
            return
        if self.loader is not None:
            self._start_layerwise(meta.loads)
            return
        start = time.perf_counter()
        rows = self._load_rows.take(len(meta.loads))
        if self.owns:
            self._wait_slots((load.tier, load.slot) for load in meta.loads)
            ok = [self._read(load, rows[i]) for i, load in enumerate(meta.loads)]
        else:
            ok = [False] * len(meta.loads)
        if self._broadcasters:
            rows, ok = self._share(rows, ok)
        good = [i for i, fine in enumerate(ok) if fine]
        if good:
            rows = rows if len(good) == len(ok) else rows[good]
            self._copier().scatter(rows, [meta.loads[i].block_ids for i in good])
        self._loads_done(meta.loads, ok)
        self._add_stats(Counter({"offload_load_seconds": time.perf_counter() - start}))

    def _loads_done(self, loads: list[LoadOp], ok: list[bool]) -> None:
        for load, fine in zip(loads, ok):
            if not fine:
                self._failed_reqs.add(load.req_id)
                self._load_errors.update(b for b in load.block_ids if b != SKIP)
        self._count_loads([load for load, fine in zip(loads, ok) if fine], ok.count(False))

    # ---- layer by layer -------------------------------------------------------------------

    def _start_layerwise(self, loads: list[LoadOp]) -> None:
        """Hand the step's loads to the loader thread; the forward waits per layer."""
        assert self.loader is not None and self.plan is not None
        self._wait_slots((load.tier, load.slot) for load in loads)
        rows = self._load_rows.take(len(loads))
        copier, steps = self._copier(), self.plan.load_steps
        max_run = 1 if copier.device.type == "cpu" else None

        def job(advance: Callable[[int], None]) -> list[bool]:
            # With checksums a load reads its whole slot first (the crc covers it all).
            ok = [
                self._read(load, rows[i]) if self.verify else self._has_groups(load)
                for i, load in enumerate(loads)
            ]
            for index, (_, segments) in enumerate(steps):
                for i, load in enumerate(loads):
                    if ok[i] and not self.verify:
                        ranges = copier.segment_ranges(segments, groups_present(load.block_ids))
                        ok[i] = not ranges or self._read_part(load, rows[i], ranges)
                good = [i for i, fine in enumerate(ok) if fine]
                if good and segments:
                    part = rows if len(good) == len(ok) else rows[good]
                    copier.scatter(part, [loads[i].block_ids for i in good], segments, max_run)
                advance(index + 1)
            return ok

        self.loader.start(job, len(loads))
        self._pending_loads = loads

    def wait_layer(self, layer: str) -> None:
        if self.loader is not None and self.loader.active:
            waited = self.loader.wait(layer)
            self._add_stats(Counter({"offload_load_seconds": waited}))

    def finish_loads(self) -> None:
        """Wait for the step's layer-wise loads (all layers) and account for them."""
        if self.loader is None:
            return
        ok = self.loader.finish()
        if ok is not None:
            self._loads_done(self._pending_loads, ok)
            self._pending_loads = []

    def _has_groups(self, load: LoadOp) -> bool:
        needed = groups_present(load.block_ids)
        if not needed <= load.stored:
            logger.warning(
                "offload: a load needs KV cache groups %s its slot lacks", sorted(needed - load.stored)
            )
            return False
        return True

    def _read_part(self, load: LoadOp, out: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
        """`ranges` of the load's slot into `out`, after checking the slot's tag (no checksum)."""
        tag = Tag(load.block_hash, load.epoch)
        try:
            if load.tier is Tier.DRAM:
                if self.dram is None or not self.dram.check(load.slot, tag, False):
                    return False
                self.dram.read(load.slot, out, ranges)
                return True
            return self.disk is not None and self.disk.read(load.slot, out, tag, False, ranges)
        except OSError:
            logger.exception("offload: reading %s slot %d failed", load.tier.name, load.slot)
            return False

    def save_layer(self, layer: str, meta: OffloadMetadata) -> None:
        """Queue the copy of the pages `layer` just finished, for the step's saves."""
        segments = self.plan.save_at.get(layer) if self.plan is not None and self.owns else None
        if not segments:
            return
        staged = self._staged
        if staged is None or staged.meta is not meta:
            saves = [op for op in meta.ops if isinstance(op, SaveOp)]
            if not saves:
                return
            staged = self._staged = StagedSaves(meta, saves, self._stage_rows.take(len(saves)))
        ids, rows, copier = [op.block_ids for op in staged.saves], staged.rows, self._copier()

        def stage() -> None:
            with torch.inference_mode():  # rows taken on the forward's thread
                copier.gather(ids, rows, segments)

        self.jobs.submit(stage)
        staged.staged_layers.add(layer)

    def _take_staged(self, meta: OffloadMetadata) -> StagedSaves | None:
        """The step's saves staged by every layer that finishes a segment (else None: a
        layer's hook did not run, and the job reads the device blocks after the forward)."""
        staged, self._staged = self._staged, None
        if staged is None or staged.meta is not meta or self.plan is None:
            return None
        return staged if staged.staged_layers == set(self.plan.save_at) else None

    def _share(self, rows: torch.Tensor, ok: list[bool]) -> tuple[torch.Tensor, list[bool]]:
        """Each owner broadcasts its rows and check results; a rank keeps its owner's. Every
        rank takes part in every broadcast (one per owner, in rank order)."""
        import torch.distributed as dist

        device = self._copier().device
        mine = rows.to(device)
        flags = torch.tensor(ok, dtype=torch.uint8, device=device)
        for owner in self._broadcasters:
            keep = owner == self.owner
            data = mine if keep else torch.empty_like(mine)
            checks = flags if keep else torch.empty_like(flags)
            dist.broadcast(data, src=owner)
            dist.broadcast(checks, src=owner)
        return mine, [bool(x) for x in flags.tolist()]

    def _read(self, load: LoadOp, out: torch.Tensor) -> bool:
        """The groups the load needs (with checksums: all the save wrote, as checked)."""
        tag = Tag(load.block_hash, load.epoch)
        needed = groups_present(load.block_ids)
        if not needed <= load.stored:
            logger.warning(
                "offload: a load needs KV cache groups %s its slot lacks", sorted(needed - load.stored)
            )
            return False
        checked = self._copier().ranges(load.stored)
        ranges = checked if self.verify else self._copier().ranges(needed)
        try:
            if load.tier is Tier.DRAM:
                if self.dram is None or not self.dram.check(load.slot, tag, self.verify, checked):
                    return False
                self.dram.read(load.slot, out, ranges)
                return True
            return self.disk is not None and self.disk.read(load.slot, out, tag, self.verify, ranges)
        except OSError:
            logger.exception("offload: reading %s slot %d failed", load.tier.name, load.slot)
            return False

    def _count_loads(self, loaded: list[LoadOp], num_failed: int) -> None:
        counts: Counter[str] = Counter()
        if self.rank == 0:
            counts["offload_loaded_blocks_dram"] = sum(1 for x in loaded if x.tier is Tier.DRAM)
            counts["offload_loaded_blocks_disk"] = sum(1 for x in loaded if x.tier is Tier.DISK)
        counts["offload_load_errors"] = num_failed  # any rank may fail on its own
        counts["offload_bytes_loaded"] = sum(self._copier().bytes_of(x.block_ids) for x in loaded)
        self._add_stats(counts)

    def _wait_slots(self, keys: Iterable[tuple[Tier, int]]) -> None:
        seq = max((self._slot_seq.get(key, 0) for key in keys), default=0)
        if seq:
            self.jobs.wait(seq)

    # ---- after the forward --------------------------------------------------------------

    def submit_ops(self, meta: OffloadMetadata) -> None:
        """Queue the step's saves and demotions as one background job, in metadata order."""
        self.finish_loads()  # which loads failed: their requests' saves are skipped
        staged = self._take_staged(meta)
        if self.rank == 0 and meta.num_evicted:
            self._add_stats(Counter({"offload_evictions": meta.num_evicted}))
        if not meta.ops:
            return
        skipped = self._failed_reqs
        # A replica's job is empty: its requests are still reported finished through it.
        ops = [op for op in meta.ops if self.owns and not (isinstance(op, SaveOp) and op.req_id in skipped)]
        seq = self.jobs.submit(lambda: self._run_ops(ops, meta.instance_id, staged))
        for op in meta.ops:
            if isinstance(op, SaveOp):
                self._slot_seq[(op.tier, op.slot)] = seq
                self._req_seq[op.req_id] = seq
                if any(op.block_ids[g] != SKIP for g in self._sliding):
                    self._window_seq = seq
            else:
                self._slot_seq[(Tier.DRAM, op.dram_slot)] = seq
                self._slot_seq[(Tier.DISK, op.disk_slot)] = seq
        if self._window_seq and self._elastic:
            self.jobs.wait(self._window_seq)

    def _run_ops(self, ops: list[SaveOp | DemoteOp], instance_id: str, staged: StagedSaves | None) -> None:
        """Background thread: saves batched while consecutive, same tier, distinct slots."""
        positions = staged.row_of() if staged is not None else {}
        i = 0
        while i < len(ops):
            op = ops[i]
            if isinstance(op, DemoteOp):
                self._demote(op, instance_id)
                i += 1
                continue
            batch: list[SaveOp] = []
            slots: set[int] = set()
            while i < len(ops):
                nxt = ops[i]
                if not isinstance(nxt, SaveOp) or nxt.tier is not op.tier or nxt.slot in slots:
                    break
                slots.add(nxt.slot)
                batch.append(nxt)
                i += 1
            rows = staged.rows_for(batch, positions) if staged is not None else None
            self._save(batch, instance_id, rows)

    def _save(self, batch: list[SaveOp], instance_id: str, staged_rows: torch.Tensor | None = None) -> None:
        """Write a batch of saves (`staged_rows`: their pages, copied layer by layer; None:
        read from the device blocks now)."""
        start = time.perf_counter()
        try:
            copier = self._copier()
            if staged_rows is None:
                staged_rows = copier.gather([op.block_ids for op in batch], self._save_rows.take(len(batch)))
            rows = staged_rows
            ranges = [copier.ranges(groups_present(op.block_ids)) for op in batch]
            tags = [
                Tag(op.block_hash, op.epoch, payload_crc(rows[k], ranges[k]) if self.verify else 0)
                for k, op in enumerate(batch)
            ]
            if batch[0].tier is Tier.DRAM:
                self._write_dram(batch, rows, tags, ranges)
            else:
                for k, op in enumerate(batch):
                    self._disk().write(op.slot, rows[k], tags[k], ranges[k])
        except Exception:
            logger.exception("offload: saving %d block(s) failed", len(batch))
            for op in batch:
                self._fail(op.tier, op.slot, op.block_hash, op.epoch, instance_id)
            return
        counts: Counter[str] = Counter(
            {
                "offload_bytes_saved": sum(self._copier().bytes_of(op.block_ids) for op in batch),
                "offload_save_seconds": time.perf_counter() - start,
            }
        )
        if self.rank == 0:
            counts["offload_saved_blocks"] = len(batch)
        self._add_stats(counts)

    def _write_dram(
        self, batch: list[SaveOp], rows: torch.Tensor, tags: list[Tag], ranges: list[list[tuple[int, int]]]
    ) -> None:
        """Whole rows in one copy when every save holds every group, else each save's ranges."""
        if all(r == ranges[0] for r in ranges) and ranges[0] == [(0, self.slot_bytes)]:
            self._dram().write([op.slot for op in batch], rows, tags)
            return
        for k, op in enumerate(batch):
            self._dram().write([op.slot], rows[k : k + 1], [tags[k]], ranges[k])

    def _demote(self, op: DemoteOp, instance_id: str) -> None:
        try:
            tag = self._dram().tag(op.dram_slot)
            if tag is None or tag.block_hash != op.block_hash or tag.epoch != op.epoch:
                raise OSError(f"DRAM slot {op.dram_slot} does not hold the block to demote")
            self._disk().write(op.disk_slot, self._dram().buffer[op.dram_slot], tag)
        except Exception:
            logger.exception("offload: demoting DRAM slot %d to disk failed", op.dram_slot)
            self._fail(Tier.DISK, op.disk_slot, op.block_hash, op.epoch, instance_id)
            return
        if self.rank == 0:
            self._add_stats(Counter({"offload_demoted_blocks": 1}))

    def _fail(self, tier: Tier, slot: int, block_hash: bytes, epoch: int, instance_id: str) -> None:
        try:
            if tier is Tier.DRAM:
                self._dram().invalidate(slot)
            else:
                self._disk().invalidate(slot)
        except Exception:
            logger.exception("offload: invalidating %s slot %d failed", tier.name, slot)
        with self._lock:
            self._stats["offload_save_errors"] += 1
            self._events.append(SaveFailed(instance_id, block_hash, epoch))

    # ---- results ------------------------------------------------------------------------

    def finished_sending(self, finished_req_ids: set[str], idle: bool) -> set[str]:
        """Finished requests whose saves all completed on this rank."""
        self._awaiting |= {r for r in finished_req_ids if r in self._req_seq}
        if not self._awaiting:
            return set()
        if idle:  # nothing else to do this step: give the saves a moment
            self.jobs.wait(min(self._req_seq[r] for r in self._awaiting), IDLE_WAIT_S)
        done = {r for r in self._awaiting if self.jobs.is_done(self._req_seq[r])}
        for req_id in done:
            del self._req_seq[req_id]
        self._awaiting -= done
        return done

    def take_load_errors(self) -> set[int]:
        self.finish_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> dict[str, float]:
        with self._lock:
            stats, self._stats = self._stats, Counter()
        return {k: v for k, v in stats.items() if v}

    def take_events(self) -> list[object]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
        self.jobs.close()
        if self.disk is not None:
            self.disk.close()

    def _add_stats(self, counts: Counter[str]) -> None:
        with self._lock:
            self._stats.update(counts)

    def _copier(self) -> BlockCopier:
        assert self.copier is not None, "register_kv_caches was not called"
        return self.copier

    def _dram(self) -> DramTier:
        if self.dram is None:
            raise OSError("offload: no DRAM tier")
        return self.dram

    def _disk(self) -> DiskTier:
        if self.disk is None:
            raise OSError("offload: no disk tier")
        return self.disk
