"""Dummy steps for warm-up: real SchedulerOutputs that take the exact path of real steps."""

from __future__ import annotations

from kvferry.config import EngineConfig
from kvferry.kv.spec import KVCacheConfig
from kvferry.sampling_params import SamplingParams
from kvferry.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

WARMUP_REQ_ID = "__kvferry_warmup__"


def warmup_steps(config: EngineConfig, kv_config: KVCacheConfig) -> list[SchedulerOutput]:
    """A prefill of a dummy request, one decode step, then a step that drops it."""
    block_size = kv_config.block_size
    limits = (2 * block_size, config.scheduler.max_num_batched_tokens, config.model.max_model_len - 1)
    num_tokens = min(limits)
    num_blocks = min(-(-(num_tokens + 1) // block_size), kv_config.num_blocks)
    blocks = tuple(list(range(num_blocks)) for _ in kv_config.groups)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    dummy = NewRequestData(WARMUP_REQ_ID, [0] * num_tokens, num_tokens, params, blocks, 0)
    return [
        SchedulerOutput([dummy], CachedRequestData(), {WARMUP_REQ_ID: num_tokens}, num_tokens, set(), set()),
        SchedulerOutput(
            [], CachedRequestData([WARMUP_REQ_ID], [None], [num_tokens]), {WARMUP_REQ_ID: 1}, 1, set(), set()
        ),
        SchedulerOutput([], CachedRequestData(), {}, 0, {WARMUP_REQ_ID}, set()),
    ]
