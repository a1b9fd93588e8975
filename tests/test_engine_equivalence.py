"""Greedy outputs identical to HF transformers: batching, chunked prefill, prefix caching, preemption."""

import pytest
import torch

from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, hf_greedy_each, make_llm, tokenize_all
from tests.tiers import LLAMA_FAST, first_fast

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def references(request):
    cache = {}

    def get(model_dir):
        if model_dir not in cache:
            prompts = tokenize_all(model_dir, PROMPT_TEXTS)
            cache[model_dir] = (prompts, hf_greedy_each(model_dir, prompts, MAX_NEW))
        return cache[model_dir]

    return get


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("tiny_model", LLAMA_FAST, indirect=True)
def test_batched_greedy_matches_hf(tiny_model, references):
    prompts, expected = references(tiny_model)
    llm = make_llm(tiny_model)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert_pool_full(llm)


@pytest.mark.parametrize("tiny_model", LLAMA_FAST, indirect=True)
def test_chunked_prefill_with_small_budget_matches_hf(tiny_model, references):
    prompts, expected = references(tiny_model)
    assert max(len(p) for p in prompts) > 16  # some prompts really need several chunks
    llm = make_llm(tiny_model, budget=16, block_size=8)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert_pool_full(llm)


@pytest.mark.parametrize("tiny_model", LLAMA_FAST, indirect=True)
def test_prefix_cache_second_pass_matches_hf_and_reports_cached_tokens(tiny_model, references):
    prompts, expected = references(tiny_model)
    llm = make_llm(tiny_model, block_size=4)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert _tokens(first) == expected and _tokens(second) == expected
    assert all(o.num_cached_tokens == 0 for o in first)
    for prompt, out in zip(prompts, second, strict=True):
        # Every full block but the one holding the last prompt token comes from the cache.
        assert out.num_cached_tokens == ((len(prompt) - 1) // 4) * 4
    assert llm.stats().prefix_cache_hits > 0
    assert_pool_full(llm)


def test_preemption_with_tiny_kv_budget_gives_same_outputs(tiny_llama, references):
    prompts, expected = references(tiny_llama)
    llm = make_llm(tiny_llama, block_size=4, num_blocks=24, prefix_caching=False)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert llm.stats().num_preemptions > 0
    assert_pool_full(llm)


@pytest.mark.parametrize("prompt_logprobs", [None, 2])
def test_a_preempted_request_continues_with_an_undisturbed_runs_bits(tiny_llama, prompt_logprobs):
    """A preempted request is recomputed as its prompt rows (prefill) and its generated rows
    (decode rows, as they were first computed), in a batch never cut between them: its
    logprobs (and prompt logprobs, read by row span) equal those of a run with room for
    every request, bit for bit. (Recomputed as one prefill, they differed in the last bits;
    cut into micro-batch parts between the two, the generated rows read KV not yet written
    and the tokens changed.)"""
    prompts = tokenize_all(tiny_llama, PROMPT_TEXTS)
    params = SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=prompt_logprobs
    )
    roomy = make_llm(tiny_llama, block_size=4, prefix_caching=False)
    tight = make_llm(tiny_llama, block_size=4, num_blocks=24, prefix_caching=False)
    undisturbed, preempted = roomy.generate(prompts, params), tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    for alone, again in zip(undisturbed, preempted, strict=True):
        assert again.outputs[0].token_ids == alone.outputs[0].token_ids
        bits = [[(lp.sampled, lp.top) for lp in out.outputs[0].logprobs] for out in (alone, again)]
        assert bits[1] == bits[0]
        assert again.prompt_logprobs == alone.prompt_logprobs
    assert_pool_full(tight)


def test_seeded_sampling_is_reproducible_across_runs_and_batches(tiny_llama):
    prompts = PROMPT_TEXTS[:4]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42)
    llm = make_llm(tiny_llama)
    alone = llm.generate(prompts[1], seeded)[0].outputs[0].token_ids
    other = SamplingParams(max_tokens=14, temperature=0.8)
    mixed = llm.generate([prompts[0], prompts[1], prompts[2]], [other, seeded, other])[1].outputs[0].token_ids
    again = make_llm(tiny_llama, seed=7).generate(prompts[1], seeded)[0].outputs[0].token_ids
    assert alone == mixed == again
    unseeded = [
        llm.generate(prompts[1], SamplingParams(max_tokens=10, temperature=1.0))[0].outputs[0].token_ids
        for _ in range(3)
    ]
    assert len({tuple(u) for u in unseeded}) > 1  # it really samples
    assert_pool_full(llm)


@pytest.mark.parametrize("tiny_model", LLAMA_FAST, indirect=True)
def test_a_prompts_last_token_alone_after_a_cache_hit_gets_the_whole_prompts_bits(tiny_model):
    """A prompt of whole blocks plus one token: its second pass finds every full block cached
    and computes the last token alone (as a P/D decoder recomputes it). That token is still a
    prompt token, computed by the prefill kernel as in the first pass, so its KV and its
    logprobs keep their bits; computed as a decode row, they differed in the last bits (and
    under GGUF's int8 activations, in the tokens that followed)."""
    _assert_cache_hits_keep_the_bits(tiny_model, block_counts=(2, 5, 9, 14))


@pytest.mark.parametrize("arch", first_fast(["mistral", "gemma3"]))
def test_sliding_window_last_tokens_after_a_cache_hit_keep_their_bits(tiny_hybrid, arch):
    """The same under sliding windows, where a chunk over cached context starts reading at
    the first block its window sees: the prefill kernel's key tiles sit at absolute
    positions, so the last token folds the tiles the whole prompt's row folds (tiles counted
    from the chunk's first visible key differed: a 37-token prompt's last token changed)."""
    _assert_cache_hits_keep_the_bits(tiny_hybrid(arch), block_counts=(2, 5, 9, 14, 30))


def _assert_cache_hits_keep_the_bits(model_dir, block_counts: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 200, (4 * blocks + 1,), generator=gen).tolist() for blocks in block_counts]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    llm = make_llm(model_dir, block_size=4)
    for prompt in prompts:
        first, second = (llm.generate([prompt], params)[0] for _ in range(2))
        assert (first.num_cached_tokens, second.num_cached_tokens) == (0, len(prompt) - 1)
        whole, cached = first.outputs[0], second.outputs[0]
        assert cached.token_ids == whole.token_ids
        assert [(lp.sampled, lp.top) for lp in cached.logprobs] == [
            (lp.sampled, lp.top) for lp in whole.logprobs
        ]
    assert_pool_full(llm)
