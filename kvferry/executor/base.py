"""Executor: runs a step on every worker and returns one ModelRunnerOutput.

The connector results of all workers are aggregated here, once, by the same component
whatever the executor (invariant 3).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvferry.config import EngineConfig
from kvferry.connector.aggregator import KVOutputAggregator
from kvferry.connector.factory import expected_finished_count
from kvferry.kv.spec import KVCacheConfig
from kvferry.kv.usage import KVMemoryUsage
from kvferry.messages.model_runner import ModelRunnerOutput
from kvferry.messages.scheduler_output import SchedulerOutput
from kvferry.worker.capture import CaptureDecision, CaptureStats
from kvferry.worker.memory_profile import MemoryProfile


class Executor(ABC):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.aggregator = KVOutputAggregator(expected_finished_count(config))

    @abstractmethod
    def prepare_memory_profile(self, num_blocks: int) -> KVCacheConfig:
        """Every rank binds a provisional KV cache of `num_blocks` blocks and starts measuring
        memory (kvferry.engine.profile_run drives it); rank 0's config comes back."""

    @abstractmethod
    def finish_memory_profile(self) -> list[MemoryProfile]:
        """Each rank's measurement of the profiling step, rank 0 first; caches released."""

    @abstractmethod
    def free_memory(self) -> list[int]:
        """Each rank's share of the memory free now (bytes), rank 0 first: the room for KV
        when the activation peak is known from an earlier start."""

    @abstractmethod
    def determine_kv_cache_config(self, budget_bytes: int) -> KVCacheConfig:
        """The scheduler's KV cache: rank 0's specs, the fewest blocks `budget_bytes` buys
        on any rank (ranks may hold different numbers of KV heads)."""

    @abstractmethod
    def initialize_kv_cache(self, kv_config: KVCacheConfig) -> None: ...

    @abstractmethod
    def execute_on_workers(self, scheduler_output: SchedulerOutput) -> list[ModelRunnerOutput]:
        """Every worker's output, rank 0 first."""

    @abstractmethod
    def capture_stats(self) -> list[CaptureStats]:
        """Each rank's captured-forward counters and decision (kvferry.worker.capture), rank 0 first."""

    @abstractmethod
    def use_capture(self, decision: CaptureDecision) -> None:
        """Every rank runs decode steps compiled or eagerly, as `decision` says."""

    @abstractmethod
    def kv_memory_usage(self) -> list[KVMemoryUsage]:
        """Each rank's KV memory, reserved and committed (kvferry.kv.memory), rank 0 first."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        outputs = self.execute_on_workers(scheduler_output)
        result = outputs[0]  # every rank samples the same tokens; rank 0's are used
        result.kv_connector_output = self.aggregator.aggregate([o.kv_connector_output for o in outputs])
        return result

    def shutdown(self) -> None:
        """Release workers."""
