"""Executor with one Ray actor per tensor-parallel rank, on a local Ray cluster (loopback).

Ray is an optional extra (`pip install kvferry[ray]`). The actors run the same Worker
as the other executors; aggregation stays in the base Executor.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kvferry.config import EngineConfig
from kvferry.errors import ConfigError
from kvferry.executor.base import Executor
from kvferry.executor.rank import R, RankSetup, WorkerCall, build_worker
from kvferry.kv.allocate import with_num_blocks
from kvferry.kv.spec import KVCacheConfig
from kvferry.kv.usage import KVMemoryUsage
from kvferry.messages.model_runner import ModelRunnerOutput
from kvferry.messages.scheduler_output import SchedulerOutput
from kvferry.ports import free_port
from kvferry.worker.capture import CaptureDecision, CaptureStats
from kvferry.worker.memory_profile import MemoryProfile
from kvferry.worker.worker import Worker

logger = logging.getLogger(__name__)


class RayWorker:
    """The Ray actor body: builds a Worker for its rank and runs the typed calls."""

    def __init__(self, setup: RankSetup):
        self.worker = build_worker(setup)

    def call(self, call: WorkerCall) -> Any:
        return call.run(self.worker)


def _start_ray(num_workers: int) -> ModuleType:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("the ray executor needs Ray: pip install 'kvferry[ray]'") from exc
    if not ray.is_initialized():
        ray.init(
            address="local",
            _node_ip_address="127.0.0.1",
            num_cpus=max(num_workers, os.cpu_count() or 1),
            include_dashboard=False,
            log_to_driver=False,
            # Actors import kvferry (and out-of-tree connectors) from the same paths as the driver.
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}},
        )
    return ray


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.world_size = config.parallel.tensor_parallel_size
        self.ray = _start_ray(self.world_size)
        actor_cls = self.ray.remote(num_cpus=0)(RayWorker)
        port = free_port()
        self.actors = [
            actor_cls.remote(RankSetup(rank, self.world_size, port, config))
            for rank in range(self.world_size)
        ]
        self.ray.get([a.__ray_ready__.remote() for a in self.actors])
        logger.info("started %d Ray worker actors", self.world_size)

    def _all(self, method: Callable[..., R], *args: Any) -> list[R]:
        call = WorkerCall(method, args)
        results: list[R] = self.ray.get([a.call.remote(call) for a in self.actors])
        return results

    def prepare_memory_profile(self, num_blocks: int) -> KVCacheConfig:
        return self._all(Worker.prepare_memory_profile, num_blocks)[0]

    def finish_memory_profile(self) -> list[MemoryProfile]:
        return self._all(Worker.finish_memory_profile)

    def free_memory(self) -> list[int]:
        return self._all(Worker.free_memory)

    def determine_kv_cache_config(self, budget_bytes: int) -> KVCacheConfig:
        configs = self._all(Worker.determine_kv_cache_config, budget_bytes)
        return with_num_blocks(configs[0], min(c.num_blocks for c in configs))

    def initialize_kv_cache(self, kv_config: KVCacheConfig) -> None:
        self._all(Worker.initialize_kv_cache, kv_config)

    def execute_on_workers(self, scheduler_output: SchedulerOutput) -> list[ModelRunnerOutput]:
        return self._all(Worker.execute_model, scheduler_output)

    def capture_stats(self) -> list[CaptureStats]:
        return self._all(Worker.capture_stats)

    def use_capture(self, decision: CaptureDecision) -> None:
        self._all(Worker.use_capture, decision)

    def kv_memory_usage(self) -> list[KVMemoryUsage]:
        return self._all(Worker.kv_memory_usage)

    def shutdown(self) -> None:
        try:
            self._all(Worker.shutdown)
        finally:
            for actor in self.actors:
                self.ray.kill(actor)
            self.ray.shutdown()
