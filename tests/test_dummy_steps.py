"""Dummy steps (warm-up, the memory-profiling run) never hand the null block to a dummy
request: a sliding-window cache reserves block 0, a full-attention cache does not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvferry.config import CacheConfig, SchedulerConfig
from kvferry.engine.profile_run import profile_steps
from kvferry.engine.warmup import dummy_block_tables, warmup_steps
from kvferry.kv.allocate import build_kv_cache_config
from kvferry.kv.null_block import NULL_BLOCK_ID
from kvferry.kv.spec import AttentionLayerKV

BLOCK = 4


def _kv_config(window: int | None, num_blocks: int):
    layers = [AttentionLayerKV(f"layers.{i}", 1, 8, window if i == 0 else None) for i in range(2)]
    cache = CacheConfig(block_size=BLOCK, num_gpu_blocks_override=num_blocks, enable_prefix_caching=False)
    return build_kv_cache_config(SimpleNamespace(dtype=torch.float32), cache, layers, 0)


def _dummy_blocks(steps) -> set[int]:
    return {b for step in steps for req in step.scheduled_new_reqs for table in req.block_ids for b in table}


@pytest.mark.parametrize(("window", "null_in_use"), [(8, False), (None, True)])
def test_dummy_requests_keep_off_the_null_block(window: int | None, null_in_use: bool) -> None:
    kv_config = _kv_config(window, num_blocks=6)
    assert kv_config.has_sliding_window is (window is not None)
    config = SimpleNamespace(model=SimpleNamespace(max_model_len=64), scheduler=SchedulerConfig())
    warmup = _dummy_blocks(warmup_steps(config, kv_config))
    profile = _dummy_blocks(profile_steps([7, 6], kv_config))
    assert (NULL_BLOCK_ID in warmup, NULL_BLOCK_ID in profile) == (null_in_use, null_in_use)
    assert len(profile) == 4  # two prompts of 2 blocks each, no id shared


def test_dummy_requests_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="need 6 blocks; the cache has 5"):
        dummy_block_tables(_kv_config(8, num_blocks=6), [3, 3])
