"""Executor: runs a step on every worker and returns one ModelRunnerOutput."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvferry.kv.spec import KVCacheConfig
from kvferry.scheduler.output import SchedulerOutput
from kvferry.worker.output import ModelRunnerOutput


class Executor(ABC):
    @abstractmethod
    def determine_kv_cache_config(self) -> KVCacheConfig: ...

    @abstractmethod
    def initialize_kv_cache(self, kv_config: KVCacheConfig) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:
        """Release workers; nothing to do in-process."""
