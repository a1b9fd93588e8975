"""The memory-profiling run: size the KV cache from what one full step really uses.

Every rank binds a provisional KV cache just large enough for the profiling step, runs one
dummy prefill at the step's maximum token budget through `Executor.execute_model` (the path
of real steps), and reports its activation peak and free memory (kvferry.worker.
memory_profile). The budget follows (kvferry.kv.budget); the provisional cache is released
before the real one is allocated. The peak is kept (kvferry.engine.profile_cache): a later
start of the same model, options and machine reads free memory alone and skips the step.
The profiling step runs before any connector exists: a connector registers the final KV
tensors, so it is created with them.
"""

from __future__ import annotations

import logging

from kvferry.config import EngineConfig
from kvferry.engine.profile_cache import profile_cache_for
from kvferry.engine.warmup import dummy_block_tables
from kvferry.executor.base import Executor
from kvferry.kv.budget import KVBudget, plan_kv_budget
from kvferry.kv.spec import KVCacheConfig
from kvferry.messages.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvferry.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROFILE_REQ_PREFIX = "__kvferry_profile_"
NULL_BLOCK_ROOM = 1  # the provisional cache keeps room for a null block


def profile_prompt_lengths(config: EngineConfig) -> list[int]:
    """Prompts that fill one step's token budget: as few as the model length allows."""
    budget = config.scheduler.max_num_batched_tokens
    longest = config.model.max_model_len - 1  # a prompt leaves room for one generated token
    lengths: list[int] = []
    while budget > 0 and len(lengths) < config.scheduler.max_num_seqs:
        lengths.append(min(budget, longest))
        budget -= lengths[-1]
    return lengths


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-(num_tokens + 1) // block_size)


def profile_num_blocks(lengths: list[int], block_size: int) -> int:
    """Blocks the provisional KV cache needs: a null block and each prompt's own."""
    return NULL_BLOCK_ROOM + sum(_blocks_for(n, block_size) for n in lengths)


def profile_steps(lengths: list[int], kv_config: KVCacheConfig) -> list[SchedulerOutput]:
    """One prefill of every profiling prompt, then a step that drops them."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    counts = [_blocks_for(length, kv_config.block_size) for length in lengths]
    requests = [
        NewRequestData(f"{PROFILE_REQ_PREFIX}{index}", [0] * length, length, params, blocks, 0)
        for index, (length, blocks) in enumerate(
            zip(lengths, dummy_block_tables(kv_config, counts), strict=True)
        )
    ]
    scheduled = {r.req_id: r.num_prompt_tokens for r in requests}
    return [
        SchedulerOutput(requests, CachedRequestData(), scheduled, sum(lengths), set(), set()),
        SchedulerOutput([], CachedRequestData(), {}, 0, set(scheduled), set()),
    ]


def size_kv_cache(executor: Executor, config: EngineConfig) -> tuple[KVBudget, KVCacheConfig]:
    """Measure (or recall) the activation peak, plan the budget, and return the scheduler's
    KV cache config."""
    cache = profile_cache_for(config)
    stored = cache.load() if cache is not None else None
    if stored is None:
        room, peak, source = run_profiling_step(executor, config)
        if cache is not None:
            cache.store(peak)
    else:
        peak = stored.activation_peak_bytes
        room = max(0, min(executor.free_memory()) - peak)
        source = f"activation peak of an earlier start's profiling step, {stored.path}"
    budget = plan_kv_budget(
        config.cache.kv_cache_bytes,
        config.cache.kv_cache_memory_fraction,
        available_bytes=room,
        activation_peak_bytes=peak,
        fixed_blocks=config.cache.num_gpu_blocks_override,
    )
    kv_config = executor.determine_kv_cache_config(budget.kv_bytes)
    logger.info(
        "KV cache: %s; %d blocks of %d tokens (%s)",
        budget.describe(),
        kv_config.num_blocks,
        kv_config.block_size,
        source,
    )
    _warn_if_short(kv_config, config.model.max_model_len)
    return budget, kv_config


def run_profiling_step(executor: Executor, config: EngineConfig) -> tuple[int, int, str]:
    """One full-budget step on a provisional cache: the room every rank has for KV (the
    least of the ranks'), the activation peak (the most), and what was run."""
    lengths = profile_prompt_lengths(config)
    provisional = executor.prepare_memory_profile(profile_num_blocks(lengths, config.cache.block_size))
    for step in profile_steps(lengths, provisional):
        executor.execute_model(step)
    profiles = executor.finish_memory_profile()
    room = min(p.room_bytes for p in profiles)
    peak = max(p.activation_peak_bytes for p in profiles)
    return room, peak, f"profiling step: {sum(lengths)} tokens, {len(lengths)} prompt(s)"


def _warn_if_short(kv_config: KVCacheConfig, max_model_len: int) -> None:
    needed = -(-max_model_len // kv_config.block_size)
    if kv_config.num_blocks < needed:
        logger.warning(
            "the KV cache holds %d blocks; one request of max_model_len %d needs %d",
            kv_config.num_blocks,
            max_model_len,
            needed,
        )
