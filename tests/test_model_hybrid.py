"""Sliding-window models (Gemma 3 text, also from a multimodal checkpoint, Mistral, Qwen2 and
Qwen3 with use_sliding_window): greedy tokens identical to HF transformers with windows shorter
than the prompts, batched, with chunked prefill, a prefix-cache second pass, preemption,
tensor parallelism and the HND layout."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvferry.engine.llm import LLM
from kvferry.errors import ModelLoadError
from kvferry.kv.spec import Layout
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm, tokenize_all
from tests.fixtures.tiny_hybrid import GEMMA3_LAYER_TYPES, WINDOW
from tests.tiers import first_fast

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
ARCHS = ("gemma3", "mistral", "qwen2_swa", "qwen3_swa")
CACHED_ARCHS = ("gemma3", "mistral", "qwen3_swa")  # a prefix-cache second pass


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid: Callable[[str], Path]):
    """arch -> (model dir, prompts, HF greedy tokens), the references computed once per module."""
    cache: dict[str, tuple[Path, list[list[int]], list[list[int]]]] = {}

    def get(arch: str) -> tuple[Path, list[list[int]], list[list[int]]]:
        if arch not in cache:
            model_dir = tiny_hybrid(arch)
            prompts = tokenize_all(model_dir, PROMPT_TEXTS)
            cache[arch] = (model_dir, prompts, hf_greedy(model_dir, prompts))
        return cache[arch]

    return get


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompts: list[list[int]], **overrides: object) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time; `overrides` change the config."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **overrides).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW,
            do_sample=False,
            pad_token_id=0,
        )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def _tokens(outputs) -> list[list[int]]:  # noqa: ANN001 - RequestOutputs
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", first_fast(ARCHS))
def test_the_window_changes_the_reference(hybrid, arch: str) -> None:
    """Without this the tests below would pass for an engine that ignores windows."""
    model_dir, prompts, expected = hybrid(arch)
    assert len(prompts) >= 8 and sum(len(p) > WINDOW for p in prompts) >= 4  # decodes pass it too
    unwindowed = hf_greedy(model_dir, prompts, sliding_window=4096)
    assert sum(a != b for a, b in zip(unwindowed, expected, strict=True)) >= 3


@pytest.mark.parametrize("arch", first_fast(ARCHS))
def test_batched_greedy_matches_hf(hybrid, arch: str) -> None:
    model_dir, prompts, expected = hybrid(arch)
    llm = make_llm(model_dir, enforce_eager=arch != "gemma3")  # gemma3: decodes captured
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert_pool_full(llm)


@pytest.mark.slow  # engines against HF references, several models
@pytest.mark.parametrize("arch", [*ARCHS, "gemma3_multimodal"])  # its text model, vision not loaded
def test_chunked_prefill_matches_hf(hybrid, arch: str) -> None:
    model_dir, prompts, expected = hybrid(arch)
    assert max(len(p) for p in prompts) > 2 * 16  # the longest prompt takes three chunks
    llm = make_llm(model_dir, budget=16, block_size=8, enforce_eager=True)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert_pool_full(llm)


@pytest.mark.slow  # engines against HF references, several models
@pytest.mark.parametrize("arch", CACHED_ARCHS)
def test_prefix_cache_second_pass_matches_hf(hybrid, arch: str) -> None:
    model_dir, prompts, expected = hybrid(arch)
    llm = make_llm(model_dir, block_size=4, enforce_eager=True)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert _tokens(first) == expected and _tokens(second) == expected
    assert all(o.num_cached_tokens == 0 for o in first)
    assert sum(o.num_cached_tokens > WINDOW for o in second) >= 3  # hits longer than the window
    assert_pool_full(llm)


# Mistral's layers all slide: a request holds about 4 blocks of 4, so preemption takes a smaller pool.
@pytest.mark.slow  # engines against HF references, several models
@pytest.mark.parametrize(("arch", "num_blocks"), [("gemma3", 40), ("mistral", 14), ("qwen3_swa", 40)])
def test_preemption_with_tiny_kv_budget_matches_hf(hybrid, arch: str, num_blocks: int) -> None:
    model_dir, prompts, expected = hybrid(arch)
    llm = make_llm(model_dir, block_size=4, num_blocks=num_blocks, prefix_caching=False, enforce_eager=True)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert llm.stats().num_preemptions > 0
    assert_pool_full(llm)


@pytest.mark.slow  # engines against HF references, several models
def test_gemma3_final_logit_softcapping_matches_hf_logprobs(tiny_hybrid: Callable[[str], Path]) -> None:
    """The final cap changes logprobs, not greedy tokens; the attention cap transformers'
    Gemma 3 never applies stays unapplied here too."""
    model_dir = tiny_hybrid("gemma3_softcap")
    prompt = tokenize_all(model_dir, PROMPT_TEXTS[5:6])[0][:24]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    llm = make_llm(model_dir, enforce_eager=True)
    prefixes = [prompt[:n] for n in range(1, len(prompt) + 1)]
    outs = llm.generate(prefixes, SamplingParams(max_tokens=1, temperature=0.0, logprobs=2))
    for n, out in enumerate(outs):
        for token, logprob in out.outputs[0].logprobs[0].top:
            assert logprob == pytest.approx(reference[n, token].item(), abs=1e-4)


@pytest.mark.slow  # TP=2 ranks
def test_tensor_parallel_and_hnd_layout_match_hf(hybrid) -> None:
    """Two ranks with one KV head each (their own specs, one agreed block count), chunked;
    then the HND layout on one rank."""
    model_dir, prompts, expected = hybrid("gemma3")
    llm = make_llm(model_dir, tp=2, budget=16, block_size=8, enforce_eager=True)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == expected
        assert_pool_full(llm)
    finally:
        llm.engine.shutdown()
    engine_config = replace(llm.config, parallel=replace(llm.config.parallel, tensor_parallel_size=1))
    hnd = LLM.from_config(replace(engine_config, cache=replace(engine_config.cache, layout="HND")))
    assert hnd.engine.scheduler.kv_cache_manager.config.layout is Layout.HND
    assert _tokens(hnd.generate(prompts, GREEDY)) == expected
    assert_pool_full(hnd)


def _copy_with_layers(model_dir: Path, out: Path, num_layers: int) -> Path:
    """A copy of the tiny Gemma 3 whose config.json says `num_layers` layers (the weights
    keep their 6)."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    config["layer_types"] = (GEMMA3_LAYER_TYPES * 2)[:num_layers]
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_checkpoint_with_more_layers_than_its_config_is_a_load_error(hybrid, tmp_path: Path) -> None:
    """26 tensors of layers 4 and 5 that the 4-layer model has no parameter for: refused,
    named (the first few and the count), not served with them skipped."""
    model_dir, _, _ = hybrid("gemma3")
    with pytest.raises(ModelLoadError, match=r"26 tensors.*model\.layers\.4\..*\(26 in all\)"):
        make_llm(_copy_with_layers(model_dir, tmp_path / "four", 4), enforce_eager=True)


def test_checkpoint_with_fewer_layers_than_its_config_is_a_load_error(hybrid, tmp_path: Path) -> None:
    model_dir, _, _ = hybrid("gemma3")
    with pytest.raises(ModelLoadError, match=r"lacks 20 weights.*model\.layers\.6\."):
        make_llm(_copy_with_layers(model_dir, tmp_path / "eight", 8), enforce_eager=True)
