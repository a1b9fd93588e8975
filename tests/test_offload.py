"""OffloadConnector end to end: same greedy outputs, prompts served from DRAM and disk tiers
after the device prefix cache lost them, and proof that the loaded bytes are really used."""

import pytest

from kvferry.config import CaptureMode
from kvferry.connector.offload.config import GIB
from kvferry.connector.offload.metadata import Tier
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm, tokenize_all
from tests.offload_support import (
    GREEDY,
    LONG,
    LONG2,
    disk_extra,
    evict_device_cache,
    fill_with_noise,
    full_blocks_before_last,
    noise_disk_payloads,
    offload_config,
    sched_half,
    tokens,
    worker_half,
)
from tests.tiers import LLAMA_FAST

PROMPTS = [*PROMPT_TEXTS, LONG]


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs without any connector, per model and prompt list."""
    cache = {}

    def get(model_dir, prompts=tuple(PROMPTS), params=GREEDY):
        key = (model_dir, tuple(map(str, prompts)), params.max_tokens)
        if key not in cache:
            cache[key] = tokens(make_llm(model_dir).generate(list(prompts), params))
        return cache[key]

    return get


@pytest.mark.slow  # several seconds (make test-all)
@pytest.mark.parametrize("tiny_model", LLAMA_FAST, indirect=True)
def test_outputs_identical_with_offload_on_and_off(tiny_model, reference):
    expected = reference(tiny_model)
    llm = make_llm(tiny_model, kv_transfer=offload_config(dram_blocks=256), capture=CaptureMode.ALWAYS)
    before = _compiled_steps(llm)
    first = llm.generate(PROMPTS, GREEDY)
    assert tokens(first) == expected
    assert min(_compiled_steps(llm)) > max(before)  # decode steps ran the captured forward
    assert_pool_full(llm)
    evict_device_cache(llm)
    second = llm.generate(PROMPTS, GREEDY)
    assert tokens(second) == expected
    for out in second:  # everything the device cache would have served came from DRAM
        assert out.num_cached_tokens == full_blocks_before_last(len(out.prompt_token_ids))
    totals = sched_half(llm).totals
    num_loaded = sum(o.num_cached_tokens for o in second) // 16
    assert num_loaded > 0 and totals["offload_loaded_blocks_dram"] == num_loaded
    # Every full prompt block saved once (not again on the second pass).
    assert totals["offload_saved_blocks"] == sum(len(o.prompt_token_ids) // 16 for o in second)
    assert totals["offload_bytes_loaded"] == num_loaded * sched_half(llm).block_bytes
    assert_pool_full(llm)


def _compiled_steps(llm) -> list[int]:
    return [stats.compiled_steps for stats in llm.engine.executor.capture_stats()]


def test_dram_tier_serves_a_repeated_prompt_and_its_bytes_are_used(tiny_llama, reference):
    expected = reference(tiny_llama, [LONG])
    llm = make_llm(tiny_llama, kv_transfer=offload_config(dram_blocks=64))
    assert tokens(llm.generate(LONG, GREEDY)) == expected
    evict_device_cache(llm)
    again = llm.generate(LONG, GREEDY)[0]
    assert again.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens == full_blocks_before_last(len(again.prompt_token_ids)) == 112
    assert sched_half(llm).totals["offload_loaded_blocks_dram"] == 7
    # Noise in the DRAM buffer (tags intact): the loads succeed and the output changes.
    evict_device_cache(llm)
    fill_with_noise(worker_half(llm).dram.buffer)
    noisy = llm.generate(LONG, GREEDY)[0]
    assert noisy.num_cached_tokens == 112 and noisy.error is None
    assert noisy.outputs[0].token_ids != expected[0]
    assert_pool_full(llm)


@pytest.mark.slow  # several seconds (make test-all)
def test_disk_tier_serves_a_prompt_demoted_out_of_dram(tiny_llama, reference, tmp_path):
    expected = reference(tiny_llama, [LONG])
    llm = make_llm(tiny_llama, kv_transfer=offload_config(**disk_extra(tmp_path, 2, 64)))
    llm.generate(LONG, GREEDY)
    llm.generate(LONG2, GREEDY)  # fills the 2 DRAM slots: every LONG block is now on disk
    index = sched_half(llm).index
    assert index.num_entries(Tier.DRAM) == 2 and index.num_entries(Tier.DISK) == 12
    evict_device_cache(llm)
    again = llm.generate(LONG, GREEDY)[0]
    assert again.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens == 112
    totals = sched_half(llm).totals
    assert totals["offload_loaded_blocks_disk"] == 7 and totals["offload_loaded_blocks_dram"] == 0
    assert totals["offload_demoted_blocks"] == 12
    # Noise over the disk payloads (headers intact): loaded, used, and the output changes.
    evict_device_cache(llm)
    noise_disk_payloads(worker_half(llm))
    noisy = llm.generate(LONG, GREEDY)[0]
    assert noisy.num_cached_tokens == 112 and noisy.outputs[0].token_ids != expected[0]
    assert_pool_full(llm)


@pytest.mark.slow  # several seconds (make test-all)
def test_disk_full_drops_the_least_recently_used_blocks(tiny_llama, reference, tmp_path):
    expected = reference(tiny_llama, [LONG, LONG2])
    llm = make_llm(tiny_llama, kv_transfer=offload_config(**disk_extra(tmp_path, 2, 6)))
    assert tokens(llm.generate([LONG], GREEDY)) == expected[:1]
    assert tokens(llm.generate([LONG2], GREEDY)) == expected[1:]
    index = sched_half(llm).index
    assert len(index) == 8 and sched_half(llm).totals["offload_evictions"] == 6
    evict_device_cache(llm)
    # LONG's first blocks were dropped: nothing to load for it; LONG2 is served in full.
    outs = llm.generate([LONG, LONG2], GREEDY)
    assert tokens(outs) == expected
    assert [o.num_cached_tokens for o in outs] == [0, 112]
    assert_pool_full(llm)


@pytest.mark.slow  # several seconds (make test-all)
def test_checksums_turn_corrupt_disk_payloads_into_load_errors(tiny_llama, reference, tmp_path):
    expected = reference(tiny_llama, [LONG])
    extra = {**disk_extra(tmp_path, 0, 16), "verify_checksum": True}
    llm = make_llm(tiny_llama, kv_transfer=offload_config("recompute", **extra))
    llm.generate(LONG, GREEDY)
    evict_device_cache(llm)
    noise_disk_payloads(worker_half(llm))
    again = llm.generate(LONG, GREEDY)[0]
    assert again.outputs[0].token_ids == expected[0] and again.error is None
    assert again.num_cached_tokens == 0  # recomputed: the failed load did not count
    assert sched_half(llm).totals["offload_load_errors"] == 7
    assert_pool_full(llm)


@pytest.mark.slow  # several seconds (make test-all)
def test_long_shared_system_prompt_survives_device_cache_eviction(tiny_llama, reference):
    system, *users, other = tokenize_all(tiny_llama, [LONG, *PROMPT_TEXTS[:2], LONG2])
    prompts = [system + users[0], system + users[1]]
    fillers = [other, other[::-1], other[40:] + other[:40], other[::-1][40:]]  # 4 x ~7 blocks
    expected = reference(tiny_llama, prompts)
    # 24 blocks of 16 tokens: a few long prompts in between evict the system prompt.
    llm = make_llm(tiny_llama, num_blocks=24, kv_transfer=offload_config(dram_blocks=64))
    assert tokens(llm.generate(prompts[0], GREEDY)) == expected[:1]
    for filler in fillers:
        llm.generate(filler, SamplingParams(max_tokens=2, ignore_eos=True))
    hits_before = llm.stats().prefix_cache_hits
    out = llm.generate(prompts[1], GREEDY)[0]
    assert llm.stats().prefix_cache_hits == hits_before  # the device cache had lost it
    assert out.outputs[0].token_ids == expected[1]
    assert out.num_cached_tokens == len(system) // 16 * 16
    assert sched_half(llm).totals["offload_loaded_blocks_dram"] == len(system) // 16
    assert_pool_full(llm)


@pytest.mark.slow  # several seconds (make test-all)
def test_preempted_requests_resume_from_the_tier(tiny_llama, reference):
    expected = reference(tiny_llama, PROMPT_TEXTS)
    transfer = offload_config(dram_blocks=512)
    llm = make_llm(tiny_llama, block_size=4, num_blocks=24, prefix_caching=False, kv_transfer=transfer)
    assert tokens(llm.generate(PROMPT_TEXTS, GREEDY)) == expected
    assert llm.stats().num_preemptions > 0
    assert sched_half(llm).totals["offload_loaded_blocks_dram"] > 0
    assert_pool_full(llm)


@pytest.mark.slow  # TP=2 ranks, compiled
def test_tp2_uneven_heads_outputs_identical_and_each_rank_stores_its_heads(
    tiny_llama_kv3, reference, tmp_path
):
    expected = reference(tiny_llama_kv3)
    block_bytes = 2 * 16 * 3 * 8 * 4 * 3  # K+V, 16 tokens, 3 KV heads, head_dim 8, fp32, 3 layers
    extra = {
        "dram_gib": 4 * block_bytes / GIB,
        "disk_dir": str(tmp_path / "tier"),
        "disk_gib": 256 * block_bytes / GIB,
    }
    llm = make_llm(tiny_llama_kv3, tp=2, kv_transfer=offload_config(**extra), capture=CaptureMode.ALWAYS)
    try:
        assert sched_half(llm).block_bytes == block_bytes and sched_half(llm).index.capacity[Tier.DRAM] == 4
        before = _compiled_steps(llm)
        assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
        assert min(_compiled_steps(llm)) > max(before)  # on both ranks
        assert_pool_full(llm)
        evict_device_cache(llm)
        second = llm.generate(PROMPTS, GREEDY)
        assert tokens(second) == expected
        num_loaded = sum(o.num_cached_tokens for o in second) // 16
        totals = sched_half(llm).totals
        # Block counts come from rank 0; bytes from both ranks (2 heads + 1 head per block).
        assert num_loaded > 0
        assert totals["offload_loaded_blocks_dram"] + totals["offload_loaded_blocks_disk"] == num_loaded
        assert totals["offload_loaded_blocks_disk"] > 0
        assert totals["offload_bytes_loaded"] == num_loaded * block_bytes
        assert_pool_full(llm)
    finally:
        llm.engine.shutdown()
    assert not list((tmp_path / "tier").iterdir())  # each rank removed its file
