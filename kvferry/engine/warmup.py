"""Dummy steps for warm-up and for timing decode steps: real SchedulerOutputs that take the
exact path of real steps."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.config import EngineConfig
from kvferry.kv.null_block import usable_block_ids
from kvferry.kv.spec import KVCacheConfig
from kvferry.messages.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvferry.sampling_params import SamplingParams

WARMUP_REQ_ID = "__kvferry_warmup__"


def dummy_block_tables(kv_config: KVCacheConfig, counts: list[int]) -> list[tuple[list[int], ...]]:
    """Block tables for dummy requests needing `counts` blocks each: consecutive runs of
    blocks that may hold KV (never the null block), the same ids in every group."""
    usable = usable_block_ids(kv_config.num_blocks, kv_config.has_sliding_window)
    if sum(counts) > len(usable):
        raise ValueError(f"dummy requests need {sum(counts)} blocks; the cache has {len(usable)}")
    tables, start = [], 0
    for count in counts:
        tables.append(tuple(usable[start : start + count] for _ in kv_config.groups))
        start += count
    return tables


def warmup_steps(config: EngineConfig, kv_config: KVCacheConfig) -> list[SchedulerOutput]:
    """A prefill of a dummy request, one decode step, then a step that drops it."""
    block_size = kv_config.block_size
    limits = (2 * block_size, config.scheduler.max_num_batched_tokens, config.model.max_model_len - 1)
    num_tokens = min(limits)
    usable = len(usable_block_ids(kv_config.num_blocks, kv_config.has_sliding_window))
    num_tokens = min(num_tokens, usable * block_size - 1)
    (blocks,) = dummy_block_tables(kv_config, [-(-(num_tokens + 1) // block_size)])
    params = SamplingParams(max_tokens=2, temperature=0.0)
    dummy = NewRequestData(WARMUP_REQ_ID, [0] * num_tokens, num_tokens, params, blocks, 0)
    return [
        SchedulerOutput([dummy], CachedRequestData(), {WARMUP_REQ_ID: num_tokens}, num_tokens, set(), set()),
        SchedulerOutput(
            [], CachedRequestData([WARMUP_REQ_ID], [None], [num_tokens]), {WARMUP_REQ_ID: 1}, 1, set(), set()
        ),
        SchedulerOutput([], CachedRequestData(), {}, 0, {WARMUP_REQ_ID}, set()),
    ]


CAPTURE_REQ_PREFIX = "__kvferry_capture_"


@dataclass(frozen=True)
class DecodeTiming:
    """Dummy requests of one token each, prefilled once, then decoded one token a step:
    the steps that time a decode batch compiled and eager (kvferry.engine.capture_choice)."""

    prefill: SchedulerOutput
    decodes: list[SchedulerOutput]
    finish: SchedulerOutput


def decode_blocks_per_request(block_size: int, num_decodes: int) -> int:
    return -(-(num_decodes + 2) // block_size)  # the prompt token, the decoded ones, a sampled one


def decode_timing_steps(kv_config: KVCacheConfig, batch_size: int, num_decodes: int) -> DecodeTiming:
    """`batch_size` dummy requests, their prefill, `num_decodes` decode steps and the drop."""
    counts = [decode_blocks_per_request(kv_config.block_size, num_decodes)] * batch_size
    params = SamplingParams(max_tokens=num_decodes + 1, temperature=0.0)
    ids = [f"{CAPTURE_REQ_PREFIX}{batch_size}_{i}" for i in range(batch_size)]
    tables = dummy_block_tables(kv_config, counts)
    new = [NewRequestData(req_id, [0], 1, params, blocks, 0) for req_id, blocks in zip(ids, tables)]
    one_each = dict.fromkeys(ids, 1)

    def decode(num_computed: int) -> SchedulerOutput:
        cached = CachedRequestData(ids, [None] * batch_size, [num_computed] * batch_size)
        return SchedulerOutput([], cached, one_each, batch_size, set(), set())

    return DecodeTiming(
        prefill=SchedulerOutput(new, CachedRequestData(), one_each, batch_size, set(), set()),
        decodes=[decode(1 + n) for n in range(num_decodes)],
        finish=SchedulerOutput([], CachedRequestData(), {}, 0, set(ids), set()),
    )
