"""Per KV cache group statistics (what /metrics shows per group): on the tiny Gemma 3
(window 10, shorter than the prompts) the sliding-window group holds a bounded number of
blocks while the full-attention group's grow with the context, clipping is counted only
for the window group, and everything is back to zero when the requests finish."""

from __future__ import annotations

import time

from kvferry.messages.engine_core import EngineCoreRequest
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import assert_pool_full, make_llm
from tests.fixtures.tiny_hybrid import WINDOW

BLOCK = 4
PROMPT_LEN = 120


def _kinds(stats) -> dict[str, object]:
    return {g.kind.split()[0]: g for g in stats.kv_groups}


def test_the_window_group_holds_what_its_window_sees(tiny_gemma3):
    llm = make_llm(tiny_gemma3, block_size=BLOCK, enforce_eager=True, budget=64)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i in range(3):
        prompt = [(7 * i + j) % 200 + 3 for j in range(PROMPT_LEN)]
        llm.engine.add_request(EngineCoreRequest(f"r{i}", prompt, greedy, time.time()))
    peak: dict[str, int] = {"full": 0, "window": 0}
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        for kind, group in _kinds(llm.stats()).items():
            peak[kind] = max(peak[kind], group.blocks_in_use)
            assert group.bytes_in_use == group.blocks_in_use * _block_bytes(llm)
    full_blocks = 3 * -(-(PROMPT_LEN + 16) // BLOCK)  # all 3 requests' whole contexts
    window_bound = 3 * (2 * -(-(WINDOW - 1) // BLOCK) + 3)  # SlidingWindowManager.max_blocks_needed
    assert 3 * window_bound < peak["full"] <= full_blocks
    assert 0 < peak["window"] <= window_bound
    groups = _kinds(llm.stats())
    assert groups["full"].blocks_clipped_total == 0
    # every window table entry the group did not hold counts: all but the last few blocks
    assert groups["window"].blocks_clipped_total >= full_blocks - window_bound
    assert all(g.blocks_in_use == g.bytes_in_use == 0 for g in groups.values())
    assert_pool_full(llm)


def _block_bytes(llm) -> int:
    config = llm.engine.scheduler.kv_cache_manager.config
    return config.pool_page_bytes // config.blocks_per_page
