"""OffloadConnector with a latent-attention cache at TP 2: one latent row per token and
layer, replicated on both ranks, stored once (rank 0's copy) and loaded into both."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvferry.connector.offload.metadata import Tier
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm, tokenize_all
from tests.fixtures.tiny_moe import KV_LORA_RANK, QK_ROPE_HEAD_DIM
from tests.offload_support import disk_extra, evict_device_cache, offload_config, sched_half, tokens
from tests.test_model_hybrid import MAX_NEW, hf_greedy

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
BLOCK = 16
NUM_LAYERS = 3  # tests/fixtures/tiny_moe.py
# One copy of a block: 16 tokens x one latent row (24 + 8 float32 values) x 3 layers.
ONE_COPY = BLOCK * (KV_LORA_RANK + QK_ROPE_HEAD_DIM) * 4 * NUM_LAYERS


@pytest.mark.slow  # two TP ranks and an HF reference
def test_tp2_latent_cache_is_stored_once_and_round_trips(
    tiny_moe: Callable[[str], Path], tmp_path: Path
) -> None:
    model_dir = tiny_moe("deepseek_v3")
    prompts = tokenize_all(model_dir, PROMPT_TEXTS)
    expected = hf_greedy(model_dir, prompts)
    transfer = offload_config(**disk_extra(tmp_path, 2, 64))  # DRAM demotes to disk
    llm = make_llm(model_dir, tp=2, block_size=BLOCK, enforce_eager=True, kv_transfer=transfer)
    try:
        sched = sched_half(llm)
        assert sched.block_bytes == ONE_COPY and sched.index.capacity[Tier.DISK] == 64
        assert tokens(llm.generate(prompts, GREEDY)) == expected
        assert_pool_full(llm)
        assert len(list((tmp_path / "tier").iterdir())) == 1  # rank 0's file; rank 1 has no tier
        evict_device_cache(llm)
        second = llm.generate(prompts, GREEDY)
        assert tokens(second) == expected
        num_loaded = sum(o.num_cached_tokens for o in second) // BLOCK
        totals = sched.totals
        assert num_loaded > 0 and totals["offload_loaded_blocks_disk"] > 0
        assert totals["offload_loaded_blocks_dram"] + totals["offload_loaded_blocks_disk"] == num_loaded
        # The tiers hold one copy of each block's latent rows; both ranks' blocks are filled.
        assert totals["offload_saved_blocks"] > 0
        assert totals["offload_bytes_saved"] == totals["offload_saved_blocks"] * ONE_COPY
        assert totals["offload_bytes_loaded"] == 2 * num_loaded * ONE_COPY
        assert_pool_full(llm)
    finally:
        llm.engine.shutdown()
    assert not list((tmp_path / "tier").iterdir())
