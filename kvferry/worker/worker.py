"""Worker: one per rank. Owns the device, the model, the KV cache tensors and the runner."""

from __future__ import annotations

import logging

import torch

from kvferry.config import EngineConfig
from kvferry.connector.base import KVConnectorRole
from kvferry.connector.factory import create_connector
from kvferry.kv.allocate import allocate_kv_caches, build_kv_cache_config, with_num_blocks
from kvferry.kv.spec import KVCacheConfig
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.loader import load_model
from kvferry.scheduler.output import SchedulerOutput
from kvferry.worker.capture import CaptureStats
from kvferry.worker.cpu_placement import place_rank
from kvferry.worker.model_runner import ModelRunner
from kvferry.worker.output import ModelRunnerOutput

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None):
        self.config = config
        self.tp = tp or TPGroup()
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            place_rank(config.parallel, self.tp.rank, self.tp.size)
        model = load_model(config.model, self.tp, self.device)
        self.runner = ModelRunner(config, model, self.device)

    def determine_kv_cache_config(self) -> KVCacheConfig:
        """This rank's KV cache: its own specs (its KV heads) and the blocks its budget holds."""
        model = self.runner.model
        names = model.attention_layer_names()
        budget = self.config.cache.kv_cache_bytes or 2 << 30
        return build_kv_cache_config(
            self.config.model, self.config.cache, names, model.num_local_kv_heads, budget
        )

    def initialize_kv_cache(self, kv_config: KVCacheConfig) -> None:
        """Allocate with this rank's own specs and the block count the ranks agreed on
        (`kv_config` is the scheduler's: rank 0's specs)."""
        kv_config = with_num_blocks(self.determine_kv_cache_config(), kv_config.num_blocks)
        kv_caches = allocate_kv_caches(kv_config, self.device)
        connector = create_connector(self.config, KVConnectorRole.WORKER, kv_config, self.tp.rank)
        if connector is not None:
            connector.register_kv_caches(kv_caches, kv_config)
        self.runner.bind_kv_caches(kv_config, kv_caches, connector)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def capture_stats(self) -> CaptureStats:
        return self.runner.forward.stats

    def shutdown(self) -> None:
        if self.runner.connector is not None:
            self.runner.connector.shutdown()
        if self.tp.size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
