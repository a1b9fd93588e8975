"""n > 1 and best_of: n answers per prompt, the prompt's KV computed once and shared
through the prefix cache (counted), best_of's ranking by cumulative logprob."""

import pytest

from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm, tokenize_all

pytestmark = pytest.mark.slow  # engines on the tiny llama (the fast tier's is tests/test_server_e2e.py)

BLOCK = 16


def _computed_prompt_tokens(llm, run):
    before = llm.stats()
    outs = run()
    after = llm.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return outs, queries - hits


def test_greedy_n3_returns_three_identical_answers_and_prefills_the_prompt_once(tiny_llama):
    llm = make_llm(tiny_llama, block_size=BLOCK)
    prompt = tokenize_all(tiny_llama, [PROMPT_TEXTS[5]])[0]
    assert len(prompt) > 2 * BLOCK
    tail = len(prompt) - (len(prompt) - 1) // BLOCK * BLOCK  # what a sibling recomputes
    params = SamplingParams(temperature=0, max_tokens=8, n=3, ignore_eos=True)
    (out,), computed = _computed_prompt_tokens(llm, lambda: llm.generate(prompt, params))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    single = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out.outputs[0].token_ids == single[0].outputs[0].token_ids
    assert computed == len(prompt) + 2 * tail  # not 3 * len(prompt)
    assert_pool_full(llm)


def test_sampled_n_differ_and_best_of_keeps_the_most_likely(tiny_llama):
    llm = make_llm(tiny_llama, block_size=BLOCK)
    prompts = tokenize_all(tiny_llama, PROMPT_TEXTS[:2])
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=5, max_tokens=6, n=4, ignore_eos=True))
    for out in outs:
        assert len(out.outputs) == 4 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    wide = SamplingParams(temperature=1.0, seed=5, max_tokens=6, n=4, logprobs=0, ignore_eos=True)
    candidates = llm.generate(prompts[0], wide)[0].outputs
    best = llm.generate(prompts[0], SamplingParams(temperature=1.0, seed=5, max_tokens=6, n=2, best_of=4))[0]
    ranked = sorted(candidates, key=lambda c: -sum(lp.sampled for lp in c.logprobs))
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert all(c.logprobs is None for c in best.outputs)  # logprobs were not asked for
    assert_pool_full(llm)


def test_prompt_logprobs_equal_hf_in_chunks_and_despite_the_prefix_cache(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    llm = make_llm(tiny_llama, block_size=BLOCK, budget=16)  # the prompt runs in 3 chunks
    prompt = tokenize_all(tiny_llama, [PROMPT_TEXTS[5]])[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    for _ in range(2):  # the second run would find the prompt in the prefix cache
        got = llm.generate(prompt, params)[0].prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        for i, entry in enumerate(got[1:], start=1):
            token = prompt[i]
            assert abs(entry[token].logprob - want[i - 1, token].item()) < 1e-4
            assert entry[token].rank == int((want[i - 1] > want[i - 1, token]).sum()) + 1
            top = want[i - 1].topk(3).indices.tolist()
            assert set(top) <= set(entry)
            assert all(entry[t].rank == rank for rank, t in enumerate(top, start=1))
    assert llm.generate(prompt, SamplingParams(max_tokens=2))[0].prompt_logprobs is None
    assert_pool_full(llm)
