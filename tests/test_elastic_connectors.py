"""Connectors over elastic KV memory: the offload connector (its copier reads sizes from
the KVCacheConfig, not tensor shapes) and P/D over real NIXL agents with elastic memory on
the decoder, the prefiller, or both. The P/D cores run eager (the subject is the memory)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvferry.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    KVTransferConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvferry.connector.offload.blocks import BlockCopier
from kvferry.engine.core import EngineCore
from kvferry.kv.spec import KVAllocator
from kvferry.messages.engine_core import EngineCoreRequest
from kvferry.model.resolve import resolve_model_config
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, tokenize_all
from tests.offload_support import LONG, full_blocks_before_last, offload_config, sched_half
from tests.test_elastic_engine import assert_all_returned, build_llm, evict_all
from tests.test_elastic_memory import elastic_config, smaps_rss
from tests.test_nixl_engine import _drain, _run

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_block_copier_reads_sizes_from_the_config_not_tensor_shapes():
    config = elastic_config(num_blocks=11)  # 12 ids reserved: the last page is partial
    assert config.virtual_num_blocks == 12
    flat = {
        name: torch.zeros(spec.size_bytes // 4, dtype=torch.float32)  # any shape: flat here
        for spec in config.tensors
        for name in spec.shared_by
    }
    copier = BlockCopier(flat, config)
    rows = torch.randint(0, 255, (2, copier.slot_bytes), dtype=torch.uint8)
    ids = [(9, 3), (11, 0)]  # one id per group; 11 lies past the budget, inside the reserve
    copier.scatter(rows, ids)
    assert torch.equal(copier.gather(ids), rows)


def test_offload_over_elastic_memory_serves_from_dram(tiny_llama: Path):
    eager = build_llm(tiny_llama, KVAllocator.EAGER)
    prompts = [*PROMPT_TEXTS, LONG]
    expected = [list(o.outputs[0].token_ids) for o in eager.generate(prompts, GREEDY)]
    llm = build_llm(tiny_llama, KVAllocator.ELASTIC, kv_transfer=offload_config(dram_blocks=256))
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)] == expected
    evict_all(llm)  # the device cache is gone and its pages returned ...
    assert smaps_rss(llm.engine.executor.worker.kv_memory) == 0
    second = llm.generate(prompts, GREEDY)  # ... so the prompts come back from DRAM
    assert [list(o.outputs[0].token_ids) for o in second] == expected
    for out in second:
        assert out.num_cached_tokens == full_blocks_before_last(len(out.prompt_token_ids))
    assert sched_half(llm).totals["offload_loaded_blocks_dram"] > 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    evict_all(llm)
    assert_all_returned(llm)


def test_multi_connector_over_elastic_memory(tiny_llama: Path, tmp_path: Path):
    prompts = [*PROMPT_TEXTS[:4], LONG]
    expected = [
        list(o.outputs[0].token_ids)
        for o in build_llm(tiny_llama, KVAllocator.EAGER).generate(prompts, GREEDY)
    ]
    offload = {"kv_connector": "OffloadConnector", "kv_connector_extra_config": {"dram_blocks": 64}}
    multi = KVTransferConfig(
        "MultiConnector", kv_connector_extra_config={"connectors": [offload, {**offload}]}
    )
    llm = build_llm(tiny_llama, KVAllocator.ELASTIC, kv_transfer=multi)
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)] == expected
    evict_all(llm)
    second = llm.generate(prompts, GREEDY)  # from the first child's DRAM tier
    assert [list(o.outputs[0].token_ids) for o in second] == expected
    assert sum(o.num_cached_tokens for o in second) > 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    evict_all(llm)
    assert_all_returned(llm)


# ---- P/D over NIXL ----------------------------------------------------------------------


def _pd_config(model_dir: Path, allocator: KVAllocator, connector: bool) -> EngineConfig:
    model = resolve_model_config(str(model_dir), dtype="float32", max_model_len=512)
    kv = KVTransferConfig("NixlConnector", kv_role="both", kv_connector_extra_config={"lease_s": 20})
    return EngineConfig(
        model=model,
        cache=CacheConfig(block_size=16, kv_cache_bytes=8 << 20, kv_allocator=allocator),
        scheduler=SchedulerConfig(64, 16, True),
        parallel=ParallelConfig(),
        kv_transfer=kv if connector else KVTransferConfig(),
        compilation=CompilationConfig(enforce_eager=True),
    )


@pytest.fixture(scope="module")
def pd_engines(tiny_qwen2: Path) -> Iterator[dict[str, EngineCore]]:
    cores = {
        "eager": EngineCore(_pd_config(tiny_qwen2, KVAllocator.EAGER, True)),
        "elastic": EngineCore(_pd_config(tiny_qwen2, KVAllocator.ELASTIC, True)),
        "elastic2": EngineCore(_pd_config(tiny_qwen2, KVAllocator.ELASTIC, True)),
        "colocated": EngineCore(_pd_config(tiny_qwen2, KVAllocator.EAGER, False)),
    }
    yield cores
    for core in cores.values():
        core.shutdown()


def _usage(core: EngineCore):  # noqa: ANN202 - KVMemoryUsage
    (usage,) = core.executor.kv_memory_usage()
    return usage


@pytest.mark.slow  # several seconds (make test-all)
def test_nixl_registration_commits_no_unmapped_page(pd_engines):
    usage = _usage(pd_engines["elastic"])  # its whole reserve is registered with NIXL
    assert usage.reserved_bytes >= 8 << 20
    assert usage.resident_bytes == usage.mapped_bytes < usage.reserved_bytes // 100


@pytest.mark.parametrize(
    ("prefill", "decode", "lead"),
    [("eager", "elastic", 7), ("elastic", "eager", 8), ("elastic", "elastic2", 9)],
)
def test_pd_over_nixl_with_elastic_memory(pd_engines, tiny_qwen2, prefill, decode, lead):
    """Request ids carry `lead`: a prefiller serves two cases, and an id it already ended
    would find its ended lease, not the new one, if the decoder asked before the new hold."""
    prefiller, decoder, colocated = pd_engines[prefill], pd_engines[decode], pd_engines["colocated"]
    prompts = [[lead, *p] for p in tokenize_all(tiny_qwen2, PROMPT_TEXTS)]
    now = time.time()
    one = SamplingParams(max_tokens=1, temperature=0)
    prefill_requests = [
        EngineCoreRequest(f"{prefill}-{lead}-p{i}", p, one, now, {"do_remote_decode": True})
        for i, p in enumerate(prompts)
    ]
    _, prefilled = _run(prefiller, prefill_requests, decoder)
    if prefill.startswith("elastic"):  # kept blocks stay mapped until the decoder has read them
        kept = prefiller.scheduler.kv_cache_manager.pool.pages.num_reported_mapped
        assert kept > 0 and _usage(prefiller).pages_mapped == kept
    decoded, finals = _run(
        decoder,
        [
            EngineCoreRequest(
                f"{decode}-{lead}-d{i}",
                p,
                GREEDY,
                now,
                prefilled[f"{prefill}-{lead}-p{i}"].kv_transfer_params,
            )
            for i, p in enumerate(prompts)
        ],
        prefiller,
    )
    expected, _ = _run(
        colocated, [EngineCoreRequest(f"c{lead}-{i}", p, GREEDY, now) for i, p in enumerate(prompts)]
    )
    for i, prompt in enumerate(prompts):
        assert decoded[f"{decode}-{lead}-d{i}"] == expected[f"c{lead}-{i}"]
        assert finals[f"{decode}-{lead}-d{i}"].num_cached_tokens == len(prompt) - 1  # read over NIXL
    _drain(prefiller, decoder)
    for name in ("elastic", "elastic2"):  # pools all free, every page returned
        elastic = pd_engines[name]
        assert elastic.scheduler.reset_prefix_cache()
        _drain(elastic)
        usage = _usage(elastic)
        assert usage.pages_mapped == 0 and usage.resident_bytes == 0
