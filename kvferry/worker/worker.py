"""Worker: one per rank. Owns the device, the model, the KV cache tensors and the runner."""

from __future__ import annotations

import gc
import logging
from dataclasses import replace

import torch

from kvferry.config import CacheConfig, EngineConfig
from kvferry.connector.base import KVConnectorRole
from kvferry.connector.factory import create_connector
from kvferry.kv.allocate import allocate_kv_caches, build_kv_cache_config
from kvferry.kv.memory import KVMemory, allocate_kv_memory, page_granularity
from kvferry.kv.spec import KVAllocator, KVCacheConfig
from kvferry.kv.usage import KVMemoryUsage
from kvferry.messages.model_runner import ModelRunnerOutput
from kvferry.messages.scheduler_output import SchedulerOutput
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.loader import load_model
from kvferry.worker.capture import CaptureDecision, CaptureStats
from kvferry.worker.cpu_placement import place_rank
from kvferry.worker.memory_profile import MemoryProbe, MemoryProfile, memory_probe
from kvferry.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None):
        self.config = config
        self.tp = replace(tp or TPGroup(), moe=config.parallel.moe_parallel)
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            place_rank(config.parallel, self.tp.rank, self.tp.size)
        model = load_model(config.model, self.tp, self.device)
        self.runner = ModelRunner(config, model, self.device)
        self._memory_probe: MemoryProbe | None = None
        self.kv_memory: KVMemory | None = None  # set by initialize_kv_cache

    def prepare_memory_profile(self, num_blocks: int) -> KVCacheConfig:
        """Bind a provisional KV cache of `num_blocks` blocks (no connector: it registers the
        final tensors) and start measuring; the engine then runs the profiling step.

        The provisional cache lives only for that step and is not drawn from a shared KV
        memory pool: a pool smaller than one full step still sizes a usable engine (whose
        too-large prompts are refused), where capping the profiling step failed the start."""
        provisional_cache = replace(
            self.config.cache, num_gpu_blocks_override=num_blocks, kv_memory_pool=None
        )
        provisional = self._kv_cache_config(provisional_cache, budget_bytes=0)
        self.runner.bind_kv_caches(provisional, allocate_kv_caches(provisional, self.device))
        self._memory_probe = self._new_memory_probe()
        self._memory_probe.start(released_after_bytes=sum(t.size_bytes for t in provisional.tensors))
        return provisional

    def finish_memory_profile(self) -> MemoryProfile:
        """What the profiling step measured; the provisional KV cache is released."""
        if self._memory_probe is None:
            raise RuntimeError("finish_memory_profile without prepare_memory_profile")
        profile = self._memory_probe.finish()
        self._memory_probe = None
        self.runner.unbind_kv_caches()
        gc.collect()
        return profile

    def free_memory(self) -> int:
        """This rank's share of the memory free now (host memory is shared by the ranks on it)."""
        probe = self._new_memory_probe()
        return probe.free_bytes() // probe.ranks_sharing_memory

    def _new_memory_probe(self) -> MemoryProbe:
        """A probe of this rank's memory: host memory is shared by the ranks on the host."""
        return memory_probe(self.device, self.tp.size if self.device.type == "cpu" else 1)

    def determine_kv_cache_config(self, budget_bytes: int) -> KVCacheConfig:
        """This rank's KV cache: its own specs (its KV heads) and the blocks `budget_bytes` holds."""
        return self._kv_cache_config(self.config.cache, budget_bytes)

    def _kv_cache_config(self, cache: CacheConfig, budget_bytes: int) -> KVCacheConfig:
        granularity = page_granularity(self.device) if cache.kv_allocator is KVAllocator.ELASTIC else None
        layers = self.runner.model.kv_layers()
        return build_kv_cache_config(
            self.config.model, cache, layers, budget_bytes, num_ranks=self.tp.size, granularity=granularity
        )

    def initialize_kv_cache(self, kv_config: KVCacheConfig) -> None:
        """Allocate with this rank's own specs and the block count the ranks agreed on
        (`kv_config` is the scheduler's: rank 0's specs)."""
        agreed = replace(self.config.cache, num_gpu_blocks_override=kv_config.num_blocks)
        kv_config = self._kv_cache_config(agreed, budget_bytes=0)
        self.kv_memory = allocate_kv_memory(kv_config, self.device)
        kv_caches = self.kv_memory.kv_caches
        connector = create_connector(self.config, KVConnectorRole.WORKER, kv_config, self.tp.rank)
        if connector is not None:
            connector.register_kv_caches(kv_caches, kv_config)
        self.runner.bind_kv_caches(kv_config, kv_caches, connector)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # Elastic KV memory: pages of newly used blocks are mapped before anything (a
        # connector's load included) writes them; freed ones are returned.
        if self.kv_memory is None:
            return self.runner.execute_model(scheduler_output)
        dummy = scheduler_output.kv_pages is None  # warm-up: blocks the pool never handed out
        if dummy:
            self.kv_memory.map_blocks(self._step_block_ids(scheduler_output))
        self.kv_memory.apply(scheduler_output.kv_pages)
        output = self.runner.execute_model(scheduler_output)
        if dummy:
            self.kv_memory.return_unplanned()
        return output

    def _step_block_ids(self, so: SchedulerOutput) -> set[int]:
        """Every block a step's requests hold, their new ones included."""
        ids: set[int] = set()
        for data in so.scheduled_new_reqs:
            ids.update(b for group in data.block_ids for b in group)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            state = self.runner.states.get(req_id)
            held = state.block_ids if state is not None else ()
            ids.update(b for group in (*held, *(new_blocks or ())) for b in group)
        return ids

    def kv_memory_usage(self) -> KVMemoryUsage:
        """What this rank's KV memory commits now (its accounting and the kernel's word)."""
        if self.kv_memory is None:
            raise RuntimeError("kv_memory_usage before initialize_kv_cache")
        return self.kv_memory.usage()

    def capture_stats(self) -> CaptureStats:
        return self.runner.bound_forward().stats

    def use_capture(self, decision: CaptureDecision) -> None:
        """Run decode steps compiled or eagerly, as the engine decided for every rank."""
        self.runner.bound_forward().use(decision)

    def shutdown(self) -> None:
        if self.runner.forward is not None:
            logger.info("%s (rank %d)", self.runner.forward.stats.describe(), self.tp.rank)
        if self.runner.connector is not None:
            self.runner.connector.shutdown()
        if self.tp.size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
