"""Injected offload load failures with layer-wise transfer (`layerwise: true`): a tier read
that fails for one layer (the second, not the first: earlier layers are already copied), a
load hook that raises (start_load_kv, wait_for_layer_load, eager and inside the compiled
program) and a loader thread that dies mid-load.

Under policy `recompute` every answer equals the engine's without offload, token for token;
under `fail` only the requests whose loads failed error (a raising hook: every request of
its step), the others answer correctly. Failed entries leave the index; pools end full.

The connectors below are loaded by module path (kv_connector_module_path), like any
out-of-tree connector.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from kvferry.config import CaptureMode
from kvferry.connector.offload.connector import OffloadConnector
from kvferry.connector.offload.layerwise import LayerLoader, LoadJob
from kvferry.connector.offload.metadata import LoadOp
from kvferry.connector.offload.worker_side import OffloadWorker
from kvferry.engine.llm import LLM
from kvferry.kv.spec import KVCacheConfig
from kvferry.messages.engine_core import FinishReason
from kvferry.outputs import RequestOutput
from kvferry.scheduler.hashing import BlockHash, hash_block_tokens
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm, tokenize_all
from tests.offload_support import (
    GREEDY,
    LONG,
    LONG2,
    disk_extra,
    evict_device_cache,
    fill_with_noise,
    offload_config,
    sched_half,
    tokens,
    worker_half,
)
from tests.test_offload_layerwise import _capture_stats, _in_attention_frame

MODULE = __name__  # the module pytest imported: the engine sees the tests' class attributes
BLOCK = 16
LOAD_FAILED = "loading the request's KV cache failed"
POLICIES = ["fail", "recompute"]


def _second_layer(worker: OffloadWorker) -> tuple[str, tuple[int, int]]:
    """The second layer in load order and the row bytes of the first segment it loads."""
    assert worker.plan is not None and worker.copier is not None
    layer, segments = worker.plan.load_steps[1]
    assert segments, "the second layer loads a segment of its own"
    segment = worker.copier.segments[segments[0]]
    return layer, (segment.offset, segment.offset + 2 * segment.half)


class _SecondLayerUnreadableWorker(OffloadWorker):
    """The tier read of the second layer's pages fails its tag check for the poisoned blocks
    (as when the slot was rewritten meanwhile): the first layer's pages were already copied."""

    poisoned: ClassVar[set[BlockHash]] = set()

    def _read_part(self, load: LoadOp, out: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
        if load.block_hash in self.poisoned and ranges[0][0] == _second_layer(self)[1][0]:
            return False
        return super()._read_part(load, out, ranges)


class SecondLayerUnreadableOffload(OffloadConnector):
    worker_class = _SecondLayerUnreadableWorker


class RaisingStartOffload(OffloadConnector):
    """start_load_kv raises whenever the step has loads, before any is started."""

    def start_load_kv(self) -> None:
        if self._meta().loads:
            raise RuntimeError("injected load failure")
        super().start_load_kv()


class RaisingAfterStartOffload(OffloadConnector):
    """start_load_kv raises whenever the step has loads, once the loader thread runs them."""

    def start_load_kv(self) -> None:
        super().start_load_kv()
        if self._meta().loads:
            raise RuntimeError("injected load failure")


class RaisingWaitOffload(OffloadConnector):
    """wait_for_layer_load of the second layer raises, without waiting, while the step's loads
    are in flight: that layer's attention may read pages the loader is still copying.
    `raised`: per raise, whether it came from the compiled program, not eager attention."""

    raised: ClassVar[list[bool]] = []

    def wait_for_layer_load(self, layer_name: str) -> None:
        worker = self._work()
        if worker.loader is not None and worker.loader.active and layer_name == _second_layer(worker)[0]:
            type(self).raised.append(not _in_attention_frame())
            raise RuntimeError("injected layer load failure")
        super().wait_for_layer_load(layer_name)


class _DyingLoader(LayerLoader):
    """The loader thread raises once the first layer is in (the next `deaths` jobs)."""

    deaths: ClassVar[int] = 0

    def start(self, job: LoadJob, num_loads: int) -> None:
        def dying(advance: Callable[[int], None]) -> list[bool]:
            def advance_then_die(layers_done: int) -> None:
                advance(layers_done)
                if layers_done == 1 and _DyingLoader.deaths > 0:
                    _DyingLoader.deaths -= 1
                    raise RuntimeError("injected loader thread failure")

            return job(advance_then_die)

        super().start(dying, num_loads)


class _DyingLoaderWorker(OffloadWorker):
    def register(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> None:
        super().register(kv_caches, kv_cache_config)
        assert self.loader is not None and self.plan is not None
        self.loader.close()
        self.loader = _DyingLoader(self.plan, f"kvferry-offload-load-rank{self.rank}")


class DyingLoaderOffload(OffloadConnector):
    worker_class = _DyingLoaderWorker


# ---- LONG and LONG2 stored, then served again beside a short prompt -----------------------


def _block_hashes(ids: list[int]) -> list[BlockHash]:
    hashes: list[BlockHash] = []
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, ids[start : start + BLOCK]))
    return hashes


def _prompts(ids: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in ids]


@pytest.fixture(scope="module")
def ids(tiny_llama: Path) -> list[list[int]]:
    """LONG, LONG2 (7 full blocks each, none in common) and a short prompt (no full block)."""
    return tokenize_all(tiny_llama, [LONG, LONG2, PROMPT_TEXTS[1]])


@pytest.fixture(scope="module")
def expected(tiny_llama: Path, ids: list[list[int]]) -> list[list[int]]:
    return tokens(make_llm(tiny_llama).generate(_prompts(ids), GREEDY))


@pytest.fixture(autouse=True)
def _injections():
    yield
    _SecondLayerUnreadableWorker.poisoned = set()
    RaisingWaitOffload.raised = []
    _DyingLoader.deaths = 0


def _engine(tiny_llama: Path, connector: str, policy: str, extra: dict | None = None, **options) -> LLM:
    kv = offload_config(policy, connector, MODULE, layerwise=True, **(extra or {"dram_blocks": 64}))
    llm = make_llm(tiny_llama, kv_transfer=kv, **options)
    assert len(llm.engine.executor.worker.runner.kv_caches) >= 3  # the second layer is not the last
    return llm


def _store_then_run(
    llm: LLM, ids: list[list[int]], stored: list[list[int]] | None = None
) -> list[RequestOutput]:
    """Compute and offload `stored` (default: LONG and LONG2, one step), drop them from the
    device, then run all three prompts: LONG's and LONG2's loads run in one step."""
    for batch in [ids[:2]] if stored is None else [[p] for p in stored]:
        llm.generate(_prompts(batch), GREEDY)
    evict_device_cache(llm)
    return llm.generate(_prompts(ids), GREEDY)


def _stored(llm: LLM, prompt: list[int]) -> int:
    """How many of the prompt's full blocks the offload index holds."""
    return sum(h in sched_half(llm).index for h in _block_hashes(prompt))


def _check(
    llm: LLM, outs: list[RequestOutput], expected: list[list[int]], policy: str, failed: list[bool]
) -> None:
    """`failed`: the requests a load failure hit. Under `fail` those error and the others
    answer correctly; under `recompute` every request answers correctly. The pool is full."""
    if policy == "fail":
        assert [o.error for o in outs] == [LOAD_FAILED if f else None for f in failed]
        for out, hit in zip(outs, failed):
            assert (out.outputs[0].finish_reason == FinishReason.ERROR) == hit
        assert [t for t, f in zip(tokens(outs), failed) if not f] == [
            t for t, f in zip(expected, failed) if not f
        ]
    else:
        assert tokens(outs) == expected and all(o.error is None for o in outs)
    assert_pool_full(llm)


def _check_long_lost_blocks(
    llm: LLM, ids: list[list[int]], expected: list[list[int]], policy: str, num_errors: int, num_kept: int
) -> None:
    """Run all three prompts with LONG's stored blocks from `num_kept` on unreadable: its
    load fails `num_errors` blocks; under `fail` those leave the index, under `recompute`
    LONG is served from the blocks before them and stores every block again."""
    outs = llm.generate(_prompts(ids), GREEDY)
    _check(llm, outs, expected, policy, [True, False, False])
    assert sched_half(llm).totals["offload_load_errors"] == num_errors
    if policy == "fail":
        assert (_stored(llm, ids[0]), _stored(llm, ids[1])) == (num_kept, 7)
    else:
        assert outs[0].num_cached_tokens == num_kept * BLOCK and _stored(llm, ids[0]) == 7


# ---- a tier read that fails for the second layer ------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("num_stored", "first_poisoned"),
    [(7, 0), (7, 3), (4, 0)],
    ids=["every-load", "later-loads", "loads-beside-saves"],
)
def test_a_read_that_fails_for_the_second_layer_fails_only_its_loads(
    tiny_llama, ids, expected, policy, num_stored, first_poisoned
):
    """LONG's stored blocks from `first_poisoned` on fail at the second layer, LONG2's load.
    `loads-beside-saves`: LONG has 4 blocks stored and computes (and saves) 3 in that step."""
    _SecondLayerUnreadableWorker.poisoned = set(_block_hashes(ids[0])[first_poisoned:])
    llm = _engine(tiny_llama, "SecondLayerUnreadableOffload", policy)
    outs = _store_then_run(llm, ids, [ids[0][: num_stored * BLOCK + 1], ids[1]])
    _check(llm, outs, expected, policy, [True, False, False])
    totals = sched_half(llm).totals
    assert totals["offload_load_errors"] == num_stored - first_poisoned
    assert outs[1].num_cached_tokens == 7 * BLOCK  # LONG2 was loaded beside it
    if policy == "fail":
        assert totals["offload_loaded_blocks_dram"] == 7 + first_poisoned
        assert totals["offload_saved_blocks"] == num_stored + 7  # nothing saved over missing KV
        # Failed loads left the index; so did what LONG's step saved over them.
        assert (_stored(llm, ids[0]), _stored(llm, ids[1])) == (first_poisoned, 7)
        # The next time LONG is computed (and saved) from the blocks that stayed valid.
        again = llm.generate(_prompts(ids[:1]), GREEDY)
        assert tokens(again) == expected[:1] and again[0].num_cached_tokens == first_poisoned * BLOCK
    else:
        assert outs[0].num_cached_tokens == first_poisoned * BLOCK  # the blocks loaded whole
    assert (_stored(llm, ids[0]), _stored(llm, ids[1])) == (7, 7)
    assert_pool_full(llm)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_disk_read_cut_short_at_the_second_layer_fails_that_load(
    tiny_llama, ids, expected, tmp_path, policy
):
    """No injected code: the disk file ends inside the second layer's pages of LONG's last
    block (the highest slot), so its tag and first layer read fine and the rest comes short."""
    llm = _engine(tiny_llama, "OffloadConnector", policy, disk_extra(tmp_path, 0, 64))
    llm.generate(_prompts(ids[1:2]), GREEDY)
    assert tokens(llm.generate(_prompts(ids[:1]), GREEDY)) == expected[:1]
    index, disk = sched_half(llm).index, worker_half(llm).disk
    assert disk is not None
    last = index.get(_block_hashes(ids[0])[-1])
    assert last is not None and last.slot == len(index) - 1
    evict_device_cache(llm)
    worker_half(llm).jobs.drain()
    os.truncate(disk.path, disk.payload_offset(last.slot) + _second_layer(worker_half(llm))[1][0] + 1)
    _check_long_lost_blocks(llm, ids, expected, policy, num_errors=1, num_kept=6)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_checksum_that_fails_for_the_second_layers_pages_fails_the_load(tiny_llama, ids, expected, policy):
    """verify_checksum: noise over only the second layer's pages of LONG's later blocks."""
    extra = {"dram_blocks": 64, "verify_checksum": True}
    llm = _engine(tiny_llama, "OffloadConnector", policy, extra)
    llm.generate(_prompts(ids[:2]), GREEDY)
    evict_device_cache(llm)
    worker = worker_half(llm)
    worker.jobs.drain()
    assert worker.dram is not None
    start, stop = _second_layer(worker)[1]
    for i, block_hash in enumerate(_block_hashes(ids[0])[3:]):
        entry = sched_half(llm).index.get(block_hash)
        assert entry is not None
        fill_with_noise(worker.dram.buffer[entry.slot, start:stop], seed=i)
    _check_long_lost_blocks(llm, ids, expected, policy, num_errors=4, num_kept=3)


# ---- the loader thread dies mid-load ------------------------------------------------------


@pytest.mark.timeout(120)  # a waiter left hanging by the dead thread hangs the test
@pytest.mark.parametrize("policy", POLICIES)
def test_a_loader_thread_that_dies_fails_the_steps_loads_then_serves_again(tiny_llama, ids, expected, policy):
    _DyingLoader.deaths = 1
    llm = _engine(tiny_llama, "DyingLoaderOffload", policy)
    outs = _store_then_run(llm, ids)
    # Both loads ran in the thread that died; the short prompt had none.
    _check(llm, outs, expected, policy, [True, True, False])
    totals = sched_half(llm).totals
    assert totals["offload_load_errors"] == 14 and totals["offload_loaded_blocks_dram"] == 0
    if policy == "fail":
        assert (_stored(llm, ids[0]), _stored(llm, ids[1])) == (0, 0)
    else:
        assert [o.num_cached_tokens for o in outs[:2]] == [0, 0]
        assert (_stored(llm, ids[0]), _stored(llm, ids[1])) == (7, 7)  # saved anew
    # The loader still runs the next step's loads.
    again = _store_then_run(llm, ids)
    assert tokens(again) == expected and [o.num_cached_tokens for o in again[:2]] == [7 * BLOCK] * 2
    assert_pool_full(llm)


# ---- a load hook that raises ---------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    "connector", ["RaisingStartOffload", "RaisingAfterStartOffload", "RaisingWaitOffload"]
)
def test_a_raising_load_hook_fails_its_steps_loads(tiny_llama, ids, expected, connector, policy):
    llm = _engine(tiny_llama, connector, policy)
    outs = _store_then_run(llm, ids)
    # A hook that raises taints every block of its step: under `fail` all three requests fail.
    _check(llm, outs, expected, policy, [True, True, True])
    assert RaisingWaitOffload.raised == ([False] if connector == "RaisingWaitOffload" else [])
    if policy == "fail":
        assert (_stored(llm, ids[0]), _stored(llm, ids[1])) == (0, 0)
        assert tokens(llm.generate(_prompts(ids), GREEDY)) == expected
    else:
        assert [o.num_cached_tokens for o in outs[:2]] == [0, 0]
    assert (_stored(llm, ids[0]), _stored(llm, ids[1])) == (7, 7)  # dropped, then saved anew
    assert_pool_full(llm)


# ---- inside the compiled forward -----------------------------------------------------------


@pytest.mark.slow  # compiles a forward
@pytest.mark.parametrize("policy", POLICIES)
def test_a_wait_that_raises_inside_the_compiled_step_fails_the_load(tiny_llama, ids, policy):
    """33 tokens of LONG: two stored blocks, then a decode-shaped step that runs compiled; its
    second layer's wait raises inside the program, through the in-graph hook operator."""
    prompt = _prompts([ids[0][:33]])
    expected = tokens(make_llm(tiny_llama).generate(prompt, GREEDY))
    llm = _engine(tiny_llama, "RaisingWaitOffload", policy, capture=CaptureMode.ALWAYS)
    assert tokens(llm.generate(prompt, GREEDY)) == expected
    evict_device_cache(llm)
    stats = _capture_stats(llm)
    compiled = stats.compiled_steps
    again = llm.generate(prompt, GREEDY)
    assert RaisingWaitOffload.raised == [True]  # once, from the compiled program
    assert stats.compiled_steps > compiled
    _check(llm, again, expected, policy, [True])
    if policy == "recompute":
        assert again[0].num_cached_tokens == 0
    assert _stored(llm, ids[0][:33]) == (0 if policy == "fail" else 2)
