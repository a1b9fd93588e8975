"""Layer-wise offload (`layerwise: true`): saves in `save_kv_layer`, loads waited for per layer
in `wait_for_layer_load`, with the same greedy float32 tokens as an engine without offload
(a plain and a sliding-window model), the same bytes as whole-request transfer, and every
pool full afterwards. A prompt whose cached prefix leaves one token to compute runs its
first step as a decode: the captured program itself waits for the layers being loaded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvferry.config import CaptureMode
from kvferry.connector.offload.blocks import BlockCopier
from kvferry.connector.offload.config import OffloadConfig
from kvferry.connector.offload.connector import OffloadConnector
from kvferry.connector.offload.layerwise import LayerPlan
from kvferry.errors import ConfigError
from kvferry.model.forward_context import HookPlacement
from kvferry.worker.capture import CaptureStats
from tests.engine_helpers import assert_pool_full, make_llm, tokenize_all
from tests.offload_support import (
    GREEDY,
    LONG,
    LONG2,
    evict_device_cache,
    full_blocks_before_last,
    offload_config,
    sched_half,
    tokens,
    worker_half,
)
from tests.test_offload_hybrid import BLOCK, _second_pass, _visible_bytes
from tests.test_offload_hybrid import prompts as prompts  # noqa: F401 - a fixture
from tests.test_offload_hybrid import reference as reference  # noqa: F401 - a fixture

ATTENTION_SOURCE = "kvferry/model/layers/attention.py"


def _in_attention_frame() -> bool:
    """Whether an eager attention layer's Python frame is on the stack (it is not when the
    compiled program calls the hook operator; a split graph resumes in that frame)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(ATTENTION_SOURCE):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class WaitRecordingOffload(OffloadConnector):
    """Records, per wait_for_layer_load, whether a layer-wise load was in flight and
    whether the call came from the compiled program rather than eager attention."""

    waits: list[tuple[str, bool, bool]] = []

    def wait_for_layer_load(self, layer_name: str) -> None:
        loader = self._work().loader
        loading = loader is not None and loader.active
        super().wait_for_layer_load(layer_name)
        type(self).waits.append((layer_name, loading, not _in_attention_frame()))


def _capture_stats(llm) -> CaptureStats:  # noqa: ANN001
    (stats,) = llm.engine.executor.capture_stats()
    return stats


@pytest.mark.slow  # compiles a forward
def test_layerwise_loads_are_waited_for_inside_the_compiled_step(tiny_llama: Path) -> None:
    """33 tokens: two stored blocks, then one token to compute, a decode-shaped step that
    runs compiled: every layer's wait, with its load in flight, is called by the program."""
    prompt = tokenize_all(tiny_llama, [LONG])[0][:33]
    expected = tokens(make_llm(tiny_llama).generate({"prompt_token_ids": prompt}, GREEDY))
    kv = offload_config(connector="WaitRecordingOffload", module=__name__, dram_blocks=16, layerwise=True)
    llm = make_llm(tiny_llama, kv_transfer=kv, capture=CaptureMode.ALWAYS)
    assert tokens(llm.generate({"prompt_token_ids": prompt}, GREEDY)) == expected
    evict_device_cache(llm)
    WaitRecordingOffload.waits.clear()
    stats = _capture_stats(llm)
    compiled, eager = stats.compiled_steps, stats.eager_steps
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY)
    assert tokens(again) == expected and again[0].num_cached_tokens == 32
    assert (stats.compiled_steps - compiled, stats.eager_steps - eager) == (GREEDY.max_tokens, 0)
    loading = [(layer, inside) for layer, busy, inside in WaitRecordingOffload.waits if busy]
    assert [layer for layer, _ in loading] == list(llm.engine.executor.worker.runner.kv_caches)
    assert all(inside for _, inside in loading)  # from the compiled program, not eager attention
    totals = sched_half(llm).totals
    assert totals["offload_loaded_blocks_dram"] == 2
    assert totals["offload_bytes_loaded"] == 2 * sched_half(llm).block_bytes
    assert worker_half(llm).loader is not None and not worker_half(llm).loader.active
    assert_pool_full(llm)


def test_layerwise_offload_serves_a_repeated_prompt(tiny_llama: Path) -> None:
    """The fast tier's end-to-end case: eager, one engine, the prompt served from DRAM."""
    expected = tokens(make_llm(tiny_llama).generate(LONG, GREEDY))
    llm = make_llm(tiny_llama, kv_transfer=offload_config(dram_blocks=64, layerwise=True))
    assert llm.engine.executor.worker.runner.forward.placement is HookPlacement.IN_GRAPH
    assert tokens(llm.generate(LONG, GREEDY)) == expected
    evict_device_cache(llm)
    again = llm.generate(LONG, GREEDY)
    assert tokens(again) == expected and again[0].num_cached_tokens == 112
    totals = sched_half(llm).totals
    assert totals["offload_loaded_blocks_dram"] == 7 and totals["offload_saved_blocks"] == 7
    assert totals["offload_bytes_loaded"] == 7 * sched_half(llm).block_bytes
    assert_pool_full(llm)


@pytest.mark.slow  # two engines, compiled
def test_layerwise_and_whole_request_offload_move_the_same_bytes(tiny_llama: Path) -> None:
    prompts = [LONG, LONG2, LONG[:200]]
    expected = tokens(make_llm(tiny_llama).generate(prompts, GREEDY))
    totals = []
    for layerwise in (False, True):
        kv = offload_config(dram_blocks=256, layerwise=layerwise)
        llm = make_llm(tiny_llama, kv_transfer=kv, capture=CaptureMode.ALWAYS)
        assert tokens(llm.generate(prompts, GREEDY)) == expected
        evict_device_cache(llm)
        second = llm.generate(prompts, GREEDY)
        assert tokens(second) == expected
        for out in second:
            assert out.num_cached_tokens == full_blocks_before_last(len(out.prompt_token_ids))
        assert_pool_full(llm)
        totals.append(sched_half(llm).totals)
    keys = (
        "offload_saved_blocks",
        "offload_loaded_blocks_dram",
        "offload_bytes_saved",
        "offload_bytes_loaded",
    )
    assert [totals[0][k] for k in keys] == [totals[1][k] for k in keys]
    assert totals[1]["offload_bytes_loaded"] > 0


@pytest.mark.slow  # the sliding-window model and its references
def test_layerwise_sliding_window_model_loads_what_the_window_sees(tiny_gemma3, prompts, reference) -> None:  # noqa: F811
    subset = prompts[4:9]
    kv = offload_config(dram_blocks=1024, layerwise=True)
    llm = make_llm(tiny_gemma3, block_size=BLOCK, budget=64, kv_transfer=kv, enforce_eager=True)
    second = _second_pass(llm, subset, reference(subset))
    hits = [o.num_cached_tokens // BLOCK for o in second]
    assert sched_half(llm).totals["offload_bytes_loaded"] == sum(_visible_bytes(h) for h in hits) > 0


def test_layerwise_flag_is_checked_and_the_plan_covers_every_segment() -> None:
    assert OffloadConfig.from_extra({"layerwise": True}).layerwise
    assert not OffloadConfig.from_extra({}).layerwise
    with pytest.raises(ConfigError, match="layerwise must be true or false"):
        OffloadConfig.from_extra({"layerwise": "yes"})
    # A tensor two layers of one group share: loaded before the first, saved after the last.
    shared = torch.zeros(2, 4, 8)
    copier = BlockCopier.__new__(BlockCopier)
    copier.segments = [
        _segment(shared, ["b", "a"]),
        _segment(torch.zeros(2, 4, 8), ["c"]),
    ]
    plan = LayerPlan.build(copier, ["a", "b", "c"])
    assert plan.load_steps == (("a", (0,)), ("b", ()), ("c", (1,)))
    assert plan.save_at == {"b": (0,), "c": (1,)}


def _segment(view: torch.Tensor, layers: list[str]):  # noqa: ANN202
    from kvferry.connector.offload.blocks import _Segment

    return _Segment(view, 0, 0, 8, layers)


@pytest.mark.slow  # two passes
def test_layerwise_load_of_a_stale_slot_is_recomputed_never_used(tiny_llama: Path) -> None:
    """Slots whose tags no longer match (as after a failed write): every layer-wise load
    fails its check, the blocks are reported, and recompute gives the right tokens."""
    expected = tokens(make_llm(tiny_llama).generate(LONG, GREEDY))
    kv = offload_config("recompute", dram_blocks=64, layerwise=True)
    llm = make_llm(tiny_llama, kv_transfer=kv)
    assert tokens(llm.generate(LONG, GREEDY)) == expected
    evict_device_cache(llm)
    worker = worker_half(llm)
    worker.jobs.drain()
    assert worker.dram is not None
    for slot in range(worker.dram.num_slots):
        worker.dram.invalidate(slot)
    assert tokens(llm.generate(LONG, GREEDY)) == expected
    totals = sched_half(llm).totals
    assert totals["offload_load_errors"] == 7 and totals["offload_bytes_loaded"] == 0
    assert_pool_full(llm)
