"""Whether decode steps keep the compiled program: decided once, at start-up.

--capture auto (the default) measures it on this machine: once warm-up has compiled the
decode program, dummy decode steps through `Executor.execute_model` (the path of real
steps, connector metadata included) are timed compiled and eager at batch 1 and at a
larger batch (min(max_num_seqs, 32), as the token budget and the KV cache allow). The two
forwards alternate and each keeps its fastest of REPEATS steps, so one slow step on a
shared host decides nothing. The program is kept when it is faster overall: its mean time
ratio to eager over the batch sizes is below 1. The engine times whole steps, every rank
included, and gives every rank the same decision (Executor.use_capture).

The decision is kept across starts (kvferry.engine.capture_cache): a start that finds one
for its model, machine, versions and options follows it before warm-up, so a cached
`eager` compiles nothing and a cached `compiled` measures nothing.

--capture always keeps the program unmeasured; never (--enforce-eager) compiles nothing.
A compile that fell back to eager on any rank leaves decode steps eager on all of them. A
model whose decoder layers all decode fused (kvferry.model.layers.fused_decode, eager steps
only) is not compiled under auto: the decision is eager, with that reason
(CaptureStats.not_compiled).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvferry.config import CaptureMode, EngineConfig
from kvferry.engine.capture_cache import CaptureCache, CaptureCacheKey, cache_for
from kvferry.engine.warmup import decode_blocks_per_request, decode_timing_steps
from kvferry.executor.base import Executor
from kvferry.kv.null_block import usable_block_ids
from kvferry.kv.spec import KVCacheConfig
from kvferry.messages.scheduler_output import SchedulerOutput
from kvferry.worker.capture import CaptureDecision, StepTiming

logger = logging.getLogger(__name__)

REPEATS = 3  # timed steps per forward and batch size; the fastest counts
LARGE_BATCH = 32  # the larger batch timed, when max_num_seqs and the caches allow it
NUM_DECODES = 2 * (REPEATS + 1)  # an untimed round first: each forward meets the shape once

RunStep = Callable[[SchedulerOutput], object]  # a dummy step through Executor.execute_model


def timed_batch_sizes(config: EngineConfig, kv_config: KVCacheConfig) -> list[int]:
    """1 and the larger batch; only 1 where no larger one fits the limits or the cache, none
    where the cache cannot hold one request's dummy decodes."""
    usable = len(usable_block_ids(kv_config.num_blocks, kv_config.has_sliding_window))
    fits = usable // decode_blocks_per_request(kv_config.block_size, NUM_DECODES)
    scheduler = config.scheduler
    large = min(LARGE_BATCH, scheduler.max_num_seqs, scheduler.max_num_batched_tokens, fits)
    return [b for b in dict.fromkeys((1, large)) if 1 <= b <= fits]


def time_step(run: RunStep, step: SchedulerOutput, compiled: bool) -> float:
    """Seconds `step` takes; `compiled` names the forward that runs it (for a test's timer)."""
    start = time.perf_counter()
    run(step)
    return time.perf_counter() - start


def measure(executor: Executor, run: RunStep, kv_config: KVCacheConfig, batch_size: int) -> StepTiming:
    """The fastest decode step of `batch_size` requests, compiled and eager, interleaved."""
    steps = decode_timing_steps(kv_config, batch_size, NUM_DECODES)
    decodes = iter(steps.decodes)
    best = {True: math.inf, False: math.inf}
    run(steps.prefill)
    for repeat in range(REPEATS + 1):
        for compiled in (True, False) if repeat % 2 else (False, True):
            executor.use_capture(CaptureDecision(CaptureMode.AUTO, compiled))
            seconds = time_step(run, next(decodes), compiled)
            if repeat:
                best[compiled] = min(best[compiled], seconds)
    run(steps.finish)
    return StepTiming(batch_size, compiled_s=best[True], eager_s=best[False])


def keeps_compiled(timings: tuple[StepTiming, ...]) -> bool:
    """Faster overall: the mean ratio of compiled to eager step time is below 1."""
    return sum(t.compiled_s / t.eager_s for t in timings) < len(timings)


@dataclass(frozen=True)
class StoredChoice:
    """This engine's place in the decision cache and what it held at start-up."""

    cache: CaptureCache
    key: CaptureCacheKey
    decision: CaptureDecision | None


def follow_stored_choice(executor: Executor, config: EngineConfig) -> StoredChoice | None:
    """Before warm-up: the decision an earlier start measured, given to every rank (so an
    eager one compiles nothing); None when --capture is not auto or no cache is configured."""
    found = cache_for(config)
    if found is None:
        return None
    cache, key = found
    decision = cache.load(key)
    if decision is not None:
        executor.use_capture(decision)
    logger.info("capture decision cache %s: %s", cache.path(key), "hit" if decision else "miss")
    return StoredChoice(cache, key, decision)


def decide_capture(
    executor: Executor,
    config: EngineConfig,
    kv_config: KVCacheConfig,
    run: RunStep,
    stored: StoredChoice | None = None,
) -> CaptureDecision:
    """After warm-up: decide (or keep the stored decision), give every rank the decision,
    keep a measured one for later starts, and log it in one line."""
    mode = config.compilation.capture
    stats = executor.capture_stats()
    compiled = mode is not CaptureMode.NEVER and all(s.compiled_steps > 0 for s in stats)
    cached = stored.decision if stored is not None else None
    not_compiled = next((s.not_compiled for s in stats if s.not_compiled is not None), None)
    if not_compiled is not None:
        decision = CaptureDecision(mode, False, not_compiled=not_compiled)
    elif cached is not None:
        decision = cached if compiled or not cached.compiled else CaptureDecision(mode, False)
    else:
        sizes = timed_batch_sizes(config, kv_config) if mode is CaptureMode.AUTO and compiled else []
        timings = tuple(measure(executor, run, kv_config, b) for b in sizes)
        decision = CaptureDecision(mode, keeps_compiled(timings) if timings else compiled, timings)
        if stored is not None and timings:
            stored.cache.store(stored.key, decision)
    executor.use_capture(decision)
    logger.info("%s", decision.describe())
    return decision
