"""Executor with a single in-process worker."""

from __future__ import annotations

from kvferry.config import EngineConfig
from kvferry.executor.base import Executor
from kvferry.kv.spec import KVCacheConfig
from kvferry.kv.usage import KVMemoryUsage
from kvferry.messages.model_runner import ModelRunnerOutput
from kvferry.messages.scheduler_output import SchedulerOutput
from kvferry.worker.capture import CaptureDecision, CaptureStats
from kvferry.worker.memory_profile import MemoryProfile
from kvferry.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.worker = Worker(config)

    def prepare_memory_profile(self, num_blocks: int) -> KVCacheConfig:
        return self.worker.prepare_memory_profile(num_blocks)

    def finish_memory_profile(self) -> list[MemoryProfile]:
        return [self.worker.finish_memory_profile()]

    def free_memory(self) -> list[int]:
        return [self.worker.free_memory()]

    def determine_kv_cache_config(self, budget_bytes: int) -> KVCacheConfig:
        return self.worker.determine_kv_cache_config(budget_bytes)

    def initialize_kv_cache(self, kv_config: KVCacheConfig) -> None:
        self.worker.initialize_kv_cache(kv_config)

    def execute_on_workers(self, scheduler_output: SchedulerOutput) -> list[ModelRunnerOutput]:
        return [self.worker.execute_model(scheduler_output)]

    def capture_stats(self) -> list[CaptureStats]:
        return [self.worker.capture_stats()]

    def use_capture(self, decision: CaptureDecision) -> None:
        self.worker.use_capture(decision)

    def kv_memory_usage(self) -> list[KVMemoryUsage]:
        return [self.worker.kv_memory_usage()]

    def shutdown(self) -> None:
        self.worker.shutdown()
