"""Gemma 4 (text) on tiny random checkpoints built offline (tests/fixtures/tiny_hybrid):
KV-shared layers, full-attention layers with twice the head size (their pages twice the
sliding ones', so the sliding groups are padded), a window shorter than the prompts,
per-layer input embeddings. Greedy tokens identical to HF transformers (float32), batched
with the captured forward (--capture always) and eager, chunked, with a prefix-cache second pass, with
preemption, over two tensor-parallel ranks; the KV-shared layers own no KV tensor."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from kvferry.config import CaptureMode
from kvferry.errors import ModelLoadError
from kvferry.kv.spec import KVCacheConfig
from kvferry.model.gemma4 import Gemma4ForCausalLM
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm, tokenize_all
from tests.fixtures.tiny_hybrid import (
    GEMMA4_GLOBAL_HEAD_DIM,
    GEMMA4_KV_SHARED,
    GEMMA4_LAYER_TYPES,
    WINDOW,
)
from tests.test_model_hybrid import hf_greedy

# slow: HF transformers references and engines for three Gemma 4 variants, TP=2 (make test-all only)
pytestmark = pytest.mark.slow

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
NUM_LAYERS = len(GEMMA4_LAYER_TYPES)
SHARED = range(NUM_LAYERS - GEMMA4_KV_SHARED, NUM_LAYERS)


@pytest.fixture(scope="module")
def gemma4(tiny_hybrid: Callable[[str], Path]):
    """arch -> (model dir, prompts, HF greedy tokens), the references computed once per module."""
    cache: dict[str, tuple[Path, list[list[int]], list[list[int]]]] = {}

    def get(arch: str) -> tuple[Path, list[list[int]], list[list[int]]]:
        if arch not in cache:
            model_dir = tiny_hybrid(arch)
            prompts = tokenize_all(model_dir, PROMPT_TEXTS)
            cache[arch] = (model_dir, prompts, hf_greedy(model_dir, prompts))
        return cache[arch]

    return get


def _tokens(outputs) -> list[list[int]]:  # noqa: ANN001 - RequestOutputs
    return [o.outputs[0].token_ids for o in outputs]


def _kv_config(llm) -> KVCacheConfig:  # noqa: ANN001 - LLM
    return llm.engine.scheduler.kv_cache_manager.config


def test_the_window_changes_the_reference(gemma4) -> None:
    """Without this the tests below would pass for an engine that ignores the window."""
    model_dir, prompts, expected = gemma4("gemma4")
    assert len(prompts) >= 8 and sum(len(p) > WINDOW for p in prompts) >= 4
    unwindowed = hf_greedy(model_dir, prompts, sliding_window=4096)
    assert sum(a != b for a, b in zip(unwindowed, expected, strict=True)) >= 3


@pytest.mark.parametrize("capture", [CaptureMode.ALWAYS, CaptureMode.NEVER], ids=["captured", "eager"])
def test_batched_greedy_matches_hf(gemma4, capture: CaptureMode) -> None:
    model_dir, prompts, expected = gemma4("gemma4")
    llm = make_llm(model_dir, capture=capture)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    (stats,) = llm.engine.executor.capture_stats()
    assert (stats.compiled_steps > 0) is (capture is CaptureMode.ALWAYS)  # decode steps ran compiled
    assert_pool_full(llm)


@pytest.mark.parametrize("arch", ["gemma4", "gemma4_k_eq_v", "gemma4_multimodal"])
def test_chunked_prefill_matches_hf(gemma4, arch: str) -> None:
    model_dir, prompts, expected = gemma4(arch)
    assert max(len(p) for p in prompts) > 2 * 16  # the longest prompt takes three chunks
    llm = make_llm(model_dir, budget=16, block_size=8, enforce_eager=True)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert_pool_full(llm)


def test_prefix_cache_second_pass_matches_hf(gemma4) -> None:
    model_dir, prompts, expected = gemma4("gemma4")
    llm = make_llm(model_dir, block_size=4, enforce_eager=True)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert _tokens(first) == expected and _tokens(second) == expected
    assert all(o.num_cached_tokens == 0 for o in first)
    assert sum(o.num_cached_tokens > WINDOW for o in second) >= 3  # hits longer than the window
    assert_pool_full(llm)


def test_preemption_with_tiny_kv_budget_matches_hf(gemma4) -> None:
    model_dir, prompts, expected = gemma4("gemma4")
    llm = make_llm(model_dir, block_size=4, num_blocks=60, prefix_caching=False, enforce_eager=True)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert llm.stats().num_preemptions > 0
    assert_pool_full(llm)


def test_tensor_parallel_matches_hf(gemma4) -> None:
    """Two ranks, one KV head of each layer each (the sliding pages padded on each rank)."""
    model_dir, prompts, expected = gemma4("gemma4")
    llm = make_llm(model_dir, tp=2, budget=16, block_size=8, enforce_eager=True)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == expected
        assert_pool_full(llm)
    finally:
        llm.engine.shutdown()


def test_kv_shared_layers_own_no_kv_tensor(gemma4) -> None:
    """On a real engine: the KV-shared layers are in no group and have no cache bound; the
    bound caches are exactly the config's tensors; the sliding groups' heads are padded to
    the full layers' page."""
    model_dir, _, _ = gemma4("gemma4")
    llm = make_llm(model_dir, enforce_eager=True)
    config = _kv_config(llm)
    owners = {f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS) if i not in SHARED}
    assert {name for g in config.groups for name in g.layer_names} == owners
    runner = llm.engine.executor.worker.runner
    assert set(runner.kv_caches) == owners
    assert len({t.data_ptr() for t in runner.kv_caches.values()}) == len(config.tensors)
    assert sum(t.size_bytes for t in config.tensors) == config.virtual_num_blocks * _pages(config)
    head_sizes = {(g.spec.head_size, g.spec.head_padding) for g in config.groups}
    assert head_sizes == {(GEMMA4_GLOBAL_HEAD_DIM, 0), (GEMMA4_GLOBAL_HEAD_DIM, 16)}


def _pages(config: KVCacheConfig) -> int:
    """Bytes one block id takes over all tensors (one page per tensor)."""
    return len(config.tensors) * config.groups[0].spec.page_size_bytes


def test_shared_layers_read_their_source_layers_cache() -> None:
    """The last three layers read layers 2 (full), 4 (sliding) and 2 again; they hold only a
    query projection."""
    from tests.fixtures.tiny_hybrid import hybrid_config

    model = Gemma4ForCausalLM(hybrid_config("gemma4", vocab_size=64, eos_id=0))
    owners = [layer.self_attn.attn.kv_owner for layer in model.model.layers]
    source = "model.layers.{}.self_attn.attn".format
    assert owners == [None] * 5 + [source(2), source(4), source(2)]
    assert not any(hasattr(model.model.layers[i].self_attn, "qkv_proj") for i in SHARED)
    assert [attn.layer_name for attn in model.attention_layers() if attn.owns_kv] == [
        kv.name for kv in model.kv_layers()
    ]
    assert model.model.layers[2].self_attn.attn.head_dim == GEMMA4_GLOBAL_HEAD_DIM


def test_config_and_weights_that_disagree_are_a_load_error(gemma4, tmp_path: Path) -> None:
    """The full layers' head size edited in config.json: the error names the shapes."""
    model_dir, _, _ = gemma4("gemma4")
    edited = tmp_path / "edited"
    shutil.copytree(model_dir, edited)
    config = json.loads((edited / "config.json").read_text())
    config["per_layer_config"] = {key: {"head_dim": 16} for key in config["per_layer_config"]}
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="checkpoint shape"):
        make_llm(edited, enforce_eager=True)


def test_mixture_of_experts_is_refused() -> None:
    from tests.fixtures.tiny_hybrid import hybrid_config

    config = hybrid_config("gemma4", vocab_size=64, eos_id=0)
    config.enable_moe_block = True
    with pytest.raises(ModelLoadError, match="mixture-of-experts"):
        Gemma4ForCausalLM(config)
