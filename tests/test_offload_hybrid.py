"""OffloadConnector with sliding-window KV cache groups (tiny Gemma 3: 2 sliding groups and a
full one, window 10 tokens, blocks of 4 tokens, 2 tensors each serving a layer of every
group). A second pass of the same prompts, after the device prefix cache lost them, is
served from the DRAM tier with the same greedy tokens as an engine without offload; it
loads every block of the full group and, of each sliding group, only the blocks the window
of the first computed token sees; those loaded bytes are really used. A hit that the
sliding groups could not use is not offered. Every pool ends all free."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kvferry.connector.offload.blocks import SKIP
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import assert_pool_full, make_llm
from tests.fixtures.tiny_hybrid import WINDOW
from tests.offload_support import (
    evict_device_cache,
    fill_with_noise,
    offload_config,
    sched_half,
    worker_half,
)
from tests.pd_support import prompt_set

BLOCK = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PAGE = BLOCK * 2 * 16 * 4 * 2  # one layer's block: 2 KV heads of 16 floats, K and V
GROUP_BYTES = 2 * PAGE  # a group's block position: one page in each of the 2 tensors
SLIDING_GROUPS = 2
WINDOW_BLOCKS = -(-(WINDOW - 1) // BLOCK)  # blocks before a hit's end its next token sees


@pytest.fixture(scope="module")
def prompts(tiny_gemma3: Path) -> list[str | list[int]]:
    return prompt_set(AutoTokenizer.from_pretrained(tiny_gemma3), BLOCK)


def _engine(model: Path, **extra):  # noqa: ANN202
    """Chunked prefill at 64 tokens a step: long prompts' early sliding blocks are freed."""
    kv = offload_config(**extra) if extra else None
    return make_llm(model, block_size=BLOCK, budget=64, kv_transfer=kv, enforce_eager=True)


def _tokens(outputs) -> list[list[int]]:  # noqa: ANN001
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_gemma3: Path):  # noqa: ANN201
    llm = _engine(tiny_gemma3)
    cache: dict = {}

    def get(prompts: list) -> list[list[int]]:
        key = tuple(map(str, prompts))
        if key not in cache:
            cache[key] = _tokens(llm.generate(list(prompts), GREEDY))
        return cache[key]

    return get


def _visible_bytes(hit_blocks: int) -> int:
    """A hit of `hit_blocks` blocks: all of the full group's, and of each sliding group the
    ones the window of the token after the hit sees."""
    return (hit_blocks + SLIDING_GROUPS * min(hit_blocks, WINDOW_BLOCKS)) * GROUP_BYTES


def test_second_pass_is_served_from_dram_with_window_visible_loads(tiny_gemma3, prompts, reference) -> None:
    expected = reference(prompts)
    llm = _engine(tiny_gemma3, dram_blocks=2048)
    sched = sched_half(llm)
    assert sched.block_bytes == (1 + SLIDING_GROUPS) * GROUP_BYTES
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    saved = sched.totals["offload_bytes_saved"]
    # Long prompts' early sliding blocks left the window before their block was full: the
    # tier holds the full group's KV there only.
    assert saved < sched.totals["offload_saved_blocks"] * sched.block_bytes
    assert_pool_full(llm)
    evict_device_cache(llm)

    second = llm.generate(prompts, GREEDY)
    assert _tokens(second) == expected
    hits = [o.num_cached_tokens // BLOCK for o in second]
    assert hits == [(len(o.prompt_token_ids) - 1) // BLOCK for o in second]
    assert sched.totals["offload_loaded_blocks_dram"] == sum(hits) > 0
    assert sched.totals["offload_bytes_loaded"] == sum(_visible_bytes(h) for h in hits)
    assert sched.totals["offload_bytes_saved"] == saved  # nothing saved again
    assert_pool_full(llm)

    # The sliding groups' loaded pages are used: noise there (tags intact) changes the output.
    evict_device_cache(llm)
    buffer = worker_half(llm).dram.buffer
    fill_with_noise(buffer[:, GROUP_BYTES:])  # the full group's range comes first in a row
    noisy = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in noisy] == [o.num_cached_tokens for o in second]
    assert _tokens(noisy) != expected
    assert_pool_full(llm)


def test_a_hit_the_sliding_groups_cannot_use_is_not_offered(tiny_gemma3, reference) -> None:
    """A stored prefix followed by more than a window's worth of new tokens: the scheduler
    allocates no sliding block that far back (the tokens after the hit would read the null
    block), so nothing is loaded; followed by a few, the hit is used."""
    base = AutoTokenizer.from_pretrained(tiny_gemma3).encode(" ".join(["a dog sees the red ball"] * 40))
    stored = base[:100]
    short_tail, long_tail = base[:103], base[:120]
    expected = reference([stored, short_tail, long_tail])
    llm = _engine(tiny_gemma3, dram_blocks=512)
    assert _tokens(llm.generate([stored], GREEDY)) == expected[:1]
    evict_device_cache(llm)
    out = llm.generate([long_tail], GREEDY)[0]
    assert list(out.outputs[0].token_ids) == expected[2] and out.num_cached_tokens == 0
    evict_device_cache(llm)
    before = sched_half(llm).totals["offload_bytes_loaded"]
    out = llm.generate([short_tail], GREEDY)[0]
    assert list(out.outputs[0].token_ids) == expected[1] and out.num_cached_tokens == 100
    assert sched_half(llm).totals["offload_bytes_loaded"] - before == _visible_bytes(25)
    assert_pool_full(llm)


def test_loads_skip_the_sliding_blocks_no_window_sees(tiny_gemma3, prompts) -> None:
    """The loads a second pass sends: every sliding id outside the window is SKIP."""
    llm = _engine(tiny_gemma3, dram_blocks=2048)
    long_prompt = prompts[7]
    llm.generate([long_prompt], GREEDY)
    evict_device_cache(llm)
    sent = []
    sched = sched_half(llm)
    real_build = sched.build_meta

    def record(so):  # noqa: ANN001, ANN202
        meta = real_build(so)
        sent.extend(meta.loads)
        return meta

    sched.build_meta = record
    llm.generate([long_prompt], GREEDY)
    sliding = [
        g
        for g, group in enumerate(llm.engine.scheduler.kv_cache_manager.config.groups)
        if group.spec.__class__.__name__ == "SlidingWindowSpec"
    ]
    assert len(sliding) == SLIDING_GROUPS
    loaded = [sum(1 for load in sent if load.block_ids[g] != SKIP) for g in sliding]
    assert len(sent) > 3 * WINDOW_BLOCKS and loaded == [WINDOW_BLOCKS] * SLIDING_GROUPS
    assert torch.tensor([load.block_ids[g] for load in sent[-WINDOW_BLOCKS:] for g in sliding]).min() > 0
    assert_pool_full(llm)


def _second_pass(llm, prompts: list, expected: list[list[int]]) -> list:  # noqa: ANN001
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert_pool_full(llm)
    evict_device_cache(llm)
    second = llm.generate(prompts, GREEDY)
    assert _tokens(second) == expected
    assert [o.num_cached_tokens for o in second] == [
        (len(o.prompt_token_ids) - 1) // BLOCK * BLOCK for o in second
    ]
    assert_pool_full(llm)
    return second


@pytest.mark.slow  # TP=2 ranks
def test_tp2_each_rank_stores_its_heads_of_every_group(tiny_gemma3, prompts, reference) -> None:
    """Two ranks, one KV head each: both load their half of the window-visible blocks."""
    subset = prompts[4:9]
    expected = reference(subset)
    llm = make_llm(
        tiny_gemma3,
        block_size=BLOCK,
        budget=64,
        kv_transfer=offload_config(dram_blocks=1024),
        tp=2,
        enforce_eager=True,
    )
    try:
        assert sched_half(llm).block_bytes == (1 + SLIDING_GROUPS) * GROUP_BYTES
        second = _second_pass(llm, subset, expected)
        hits = [o.num_cached_tokens // BLOCK for o in second]
        assert sched_half(llm).totals["offload_bytes_loaded"] == sum(_visible_bytes(h) for h in hits) > 0
    finally:
        llm.engine.shutdown()


@pytest.mark.slow  # a second model and its references
def test_gemma4_padded_pages_and_kv_shared_layers(tiny_gemma4: Path, reference) -> None:  # noqa: ARG001
    """Tiny Gemma 4: 4 sliding groups and a full one of 1 layer each in one tensor (pages of
    2 x 32 floats; the sliding layers' 16-float heads padded); the 3 KV-shared layers own no
    KV and add nothing to a slot."""
    model = tiny_gemma4
    subset = prompt_set(AutoTokenizer.from_pretrained(model), BLOCK)[4:12]
    expected = _tokens(_engine(model).generate(subset, GREEDY))
    llm = _engine(model, dram_blocks=2048)
    page = BLOCK * 2 * 32 * 4 * 2
    assert sched_half(llm).block_bytes == 5 * page
    second = _second_pass(llm, subset, expected)
    hits = [o.num_cached_tokens // BLOCK for o in second]
    loaded = sum((h + 4 * min(h, WINDOW_BLOCKS)) * page for h in hits)
    assert sched_half(llm).totals["offload_bytes_loaded"] == loaded > 0


def test_disk_tier_with_checksums_reads_what_was_saved_and_loads_the_window(
    tiny_gemma3, prompts, reference, tmp_path
) -> None:
    """No DRAM tier: slots on disk hold some groups only; a checked load reads the ranges the
    save wrote (its crc covers them) and copies only the window-visible ones."""
    subset = prompts[4:9]
    expected = reference(subset)
    extra = {
        "dram_blocks": 0,
        "disk_dir": str(tmp_path / "tier"),
        "disk_blocks": 1024,
        "verify_checksum": True,
    }
    llm = _engine(tiny_gemma3, **extra)
    second = _second_pass(llm, subset, expected)
    totals = sched_half(llm).totals
    hits = [o.num_cached_tokens // BLOCK for o in second]
    assert totals["offload_loaded_blocks_disk"] == sum(hits) > 0 and not totals["offload_load_errors"]
    assert totals["offload_bytes_loaded"] == sum(_visible_bytes(h) for h in hits)


def test_elastic_kv_memory(tiny_gemma3, prompts, reference) -> None:
    """Elastic KV memory returns a freed block's page before the next step's hooks: saves of
    sliding blocks complete within their step; the second pass is served from DRAM."""
    from kvferry.engine.llm import LLM

    subset = prompts[4:9]
    expected = reference(subset)
    llm = LLM(
        str(tiny_gemma3),
        dtype="float32",
        max_model_len=512,
        block_size=BLOCK,
        max_num_batched_tokens=64,
        kv_cache_bytes=64 << 20,
        kv_allocator="elastic",
        enforce_eager=True,
        kv_transfer=offload_config(dram_blocks=1024),
    )
    assert llm.engine.scheduler.kv_cache_manager.config.is_elastic
    second = _second_pass(llm, subset, expected)
    hits = [o.num_cached_tokens // BLOCK for o in second]
    assert sched_half(llm).totals["offload_bytes_loaded"] == sum(_visible_bytes(h) for h in hits) > 0
