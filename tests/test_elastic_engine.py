"""Elastic KV memory in real engines on the tiny models: greedy outputs identical to eager
(prefix caching, chunked prefill, preemption, sliding windows, TP=2), resident memory that
follows the blocks in use, and every page returned once requests finish and the cache is
evicted."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    KVTransferConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvferry.engine.llm import LLM
from kvferry.kv.spec import KVAllocator
from kvferry.model.resolve import resolve_model_config
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full
from tests.test_elastic_memory import smaps_rss

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def build_llm(
    model_dir: Path,
    allocator: KVAllocator,
    *,
    num_blocks: int | None = None,
    budget: int = 2048,
    prefix_caching: bool = True,
    tp: int = 1,
    kv_transfer: KVTransferConfig | None = None,
) -> LLM:
    model = resolve_model_config(str(model_dir), dtype="float32", max_model_len=512)
    config = EngineConfig(
        model=model,
        cache=CacheConfig(
            block_size=16,
            kv_cache_bytes=64 << 20,
            num_gpu_blocks_override=num_blocks,
            enable_prefix_caching=prefix_caching,
            kv_allocator=allocator,
        ),
        scheduler=SchedulerConfig(budget, 64, True),
        parallel=ParallelConfig(tensor_parallel_size=tp),
        compilation=CompilationConfig(enforce_eager=True),
        kv_transfer=kv_transfer or KVTransferConfig(),
    )
    return LLM.from_config(config)


def tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]


def evict_all(llm: LLM) -> None:
    """Drop the prefix cache and run the steps that tell the workers."""
    assert llm.engine.scheduler.reset_prefix_cache()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def assert_memory_accounted(llm: LLM) -> None:
    """Every rank commits exactly the pages the block pool told the workers to hold (its
    changes reach them with the next step)."""
    pages = llm.engine.scheduler.kv_cache_manager.pool.pages
    for usage in llm.engine.executor.kv_memory_usage():
        assert usage.pages_mapped == pages.num_reported_mapped
        assert usage.resident_bytes == usage.mapped_bytes  # the kernel agrees (mincore)


def assert_all_returned(llm: LLM, kept_pages: int = 0) -> None:
    """Pool back to full and every page returned (but the null block's)."""
    assert_pool_full(llm)
    assert_memory_accounted(llm)
    assert not llm.engine.scheduler.kv_cache_manager.has_page_changes()
    for usage in llm.engine.executor.kv_memory_usage():
        assert usage.pages_mapped == kept_pages


def run_twice(llm: LLM, prompts: list[str]) -> list[list[int]]:
    """A first pass, then the same prompts again (prefix-cache hits)."""
    return tokens(llm, prompts) + tokens(llm, prompts)


@pytest.fixture(scope="module")
def tight_eager(tiny_llama: Path) -> tuple[list[list[int]], int]:
    """Eager outputs and preemption count with a small pool and a small token budget."""
    llm = build_llm(tiny_llama, KVAllocator.EAGER, num_blocks=24, budget=48)
    return run_twice(llm, PROMPT_TEXTS), llm.stats().num_preemptions


def test_greedy_identical_with_prefix_caching_chunked_prefill_and_preemption(tiny_llama, tight_eager):
    expected, eager_preemptions = tight_eager
    llm = build_llm(tiny_llama, KVAllocator.ELASTIC, num_blocks=24, budget=48)
    assert run_twice(llm, PROMPT_TEXTS) == expected
    stats = llm.stats()
    assert stats.num_preemptions == eager_preemptions > 0  # same budget, same schedule
    assert stats.prefix_cache_hits > 0
    evict_all(llm)
    assert_all_returned(llm)


@pytest.mark.slow  # the 135M SmolLM2, twice
def test_smollm2_greedy_identical_with_preemption(smollm2_gguf):
    eager = build_llm(smollm2_gguf, KVAllocator.EAGER, num_blocks=20, budget=48)
    expected = run_twice(eager, PROMPT_TEXTS)
    eager_preemptions = eager.stats().num_preemptions
    eager.engine.shutdown()
    llm = build_llm(smollm2_gguf, KVAllocator.ELASTIC, num_blocks=20, budget=48)
    assert run_twice(llm, PROMPT_TEXTS) == expected
    assert llm.stats().num_preemptions == eager_preemptions > 0
    evict_all(llm)
    assert_all_returned(llm)


def test_resident_memory_follows_the_blocks_in_use(tiny_llama):
    llm = build_llm(tiny_llama, KVAllocator.ELASTIC, num_blocks=128, prefix_caching=False)
    memory = llm.engine.executor.worker.kv_memory
    assert smaps_rss(memory) == 0 and llm.engine.executor.kv_memory_usage()[0].reserved_bytes > 0
    peaks = []
    for batch in (PROMPT_TEXTS[:1], PROMPT_TEXTS):
        for index, prompt in enumerate(batch):
            request = llm.inputs.process(f"{len(peaks)}-{index}", prompt, GREEDY)
            llm.engine.add_request(request)
        peak = 0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            assert_memory_accounted(llm)
            assert smaps_rss(memory) == memory.mapped_bytes  # /proc/self/smaps agrees too
            peak = max(peak, memory.mapped_bytes)
        peaks.append(peak)
        assert smaps_rss(memory) == 0  # no prefix cache: finished requests return everything
        assert_all_returned(llm)
    assert 0 < peaks[0] < peaks[1]
    pool = llm.engine.scheduler.kv_cache_manager.pool
    assert peaks[1] <= (pool.num_blocks // memory.blocks_per_page + 1) * memory.page_bytes


def test_cached_prefixes_stay_resident_until_evicted(tiny_llama):
    llm = build_llm(tiny_llama, KVAllocator.ELASTIC, num_blocks=128)
    memory = llm.engine.executor.worker.kv_memory
    tokens(llm, PROMPT_TEXTS)
    assert_pool_full(llm)
    assert memory.mapped_bytes > 0 and smaps_rss(memory) == memory.mapped_bytes
    evict_all(llm)
    assert smaps_rss(memory) == 0
    assert_all_returned(llm)


def test_sliding_window_model_identical_and_pages_returned(tiny_gemma3):
    model_dir = tiny_gemma3
    long_prompts = [" ".join([text] * 3) for text in PROMPT_TEXTS[:6]]
    eager = build_llm(model_dir, KVAllocator.EAGER, num_blocks=40, budget=64)
    expected = run_twice(eager, long_prompts)
    llm = build_llm(model_dir, KVAllocator.ELASTIC, num_blocks=40, budget=64)
    assert run_twice(llm, long_prompts) == expected
    evict_all(llm)
    assert_all_returned(llm, kept_pages=1)  # the null block's page


@pytest.mark.slow  # TP=2 ranks
def test_tp2_elastic_identical_and_every_rank_returns_its_pages(tiny_llama, tight_eager):
    expected, _ = tight_eager
    llm = build_llm(tiny_llama, KVAllocator.ELASTIC, num_blocks=24, budget=48, tp=2)
    try:
        assert run_twice(llm, PROMPT_TEXTS) == expected
        usages = llm.engine.executor.kv_memory_usage()
        assert len(usages) == 2 and all(u.pages_mapped > 0 for u in usages)  # cached prefixes
        evict_all(llm)
        assert_all_returned(llm)
    finally:
        llm.engine.shutdown()
