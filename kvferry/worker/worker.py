"""Worker: one per rank. Owns the device, the model, the KV cache tensors and the runner."""

from __future__ import annotations

import logging

import torch

from kvferry.config import EngineConfig
from kvferry.kv.allocate import allocate_kv_caches, build_kv_cache_config
from kvferry.kv.spec import KVCacheConfig
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.loader import load_model
from kvferry.sampling_params import SamplingParams
from kvferry.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from kvferry.worker.model_runner import ModelRunner
from kvferry.worker.output import ModelRunnerOutput

logger = logging.getLogger(__name__)

WARMUP_REQ_ID = "__kvferry_warmup__"


class Worker:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None):
        self.config = config
        self.tp = tp or TPGroup()
        self.device = torch.device(config.device)
        model = load_model(config.model, self.tp, self.device)
        self.runner = ModelRunner(config, model, self.device)
        self.kv_config: KVCacheConfig | None = None

    def determine_kv_cache_config(self) -> KVCacheConfig:
        names = self.runner.model.attention_layer_names()
        return build_kv_cache_config(self.config.model, self.config.cache, names, tp_size=self.tp.size)

    def initialize_kv_cache(self, kv_config: KVCacheConfig) -> None:
        self.kv_config = kv_config
        self.runner.bind_kv_caches(kv_config, allocate_kv_caches(kv_config, self.device))

    def warm_up(self) -> None:
        """Run a dummy prefill and decode through the exact path real steps take."""
        block_size = self.kv_config.block_size
        num_tokens = min(
            2 * block_size, self.config.scheduler.max_num_batched_tokens, self.config.model.max_model_len - 1
        )
        num_blocks = min(-(-(num_tokens + 1) // block_size), self.kv_config.num_blocks)
        blocks = tuple(list(range(num_blocks)) for _ in self.kv_config.groups)
        dummy = NewRequestData(
            WARMUP_REQ_ID, [0] * num_tokens, num_tokens, SamplingParams(max_tokens=2), blocks, 0
        )
        prefill = SchedulerOutput(
            [dummy], CachedRequestData(), {WARMUP_REQ_ID: num_tokens}, num_tokens, set(), set()
        )
        self.execute_model(prefill)
        decode_data = CachedRequestData([WARMUP_REQ_ID], [None], [num_tokens])
        self.execute_model(SchedulerOutput([], decode_data, {WARMUP_REQ_ID: 1}, 1, set(), set()))
        self.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, {WARMUP_REQ_ID}, set()))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)
