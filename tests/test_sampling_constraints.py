"""min_tokens, logit_bias, allowed_token_ids and bad_words: the sampler's batched masks,
their validation, and greedy min_tokens against HF transformers' min_new_tokens."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvferry.constraint_params import check_some_token_allowed
from kvferry.errors import InvalidRequestError
from kvferry.messages.scheduler_output import NewRequestData
from kvferry.sampling_params import SamplingParams
from kvferry.worker.logits_constraints import banned_by_bad_words
from kvferry.worker.request_state import RequestState, build_sampling_batch
from kvferry.worker.sampler import Sampler
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm, tokenize_all

VOCAB = 40
EOS = (7,)


def _sample(logits, params_list, outputs=()):
    states = [
        RequestState.from_new(NewRequestData(str(i), [1, 2, *outputs], 2, p, ([0],), 0))
        for i, p in enumerate(params_list)
    ]
    batch = build_sampling_batch(states, EOS)
    tokens = Sampler(torch.Generator().manual_seed(0))(logits, batch).tokens
    return tokens, batch


def _peaked(token: int, rows: int = 1) -> torch.Tensor:
    logits = torch.zeros(rows, VOCAB)
    logits[:, token] = 10.0
    return logits


def test_no_constraint_leaves_the_batch_on_the_fast_path():
    _, batch = _sample(_peaked(3), [SamplingParams(temperature=0)])
    assert batch.constraints is None


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = _peaked(7, 3)
    logits[:, 9] = 9.0  # a stop token next
    logits[:, 4] = 8.0
    params = [
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[9]),
        SamplingParams(temperature=0, min_tokens=1),  # already reached: EOS allowed
        SamplingParams(temperature=0, min_tokens=2, ignore_eos=True),  # EOS not a stop
    ]
    tokens, _ = _sample(logits, params, outputs=[5])
    assert tokens == [4, 7, 7]


def test_logit_bias_and_allowed_token_ids_per_row():
    logits = _peaked(3, 3)
    params = [
        SamplingParams(temperature=0, logit_bias={5: 100.0}),
        SamplingParams(temperature=0, allowed_token_ids=[11, 12]),
        SamplingParams(temperature=0, logit_bias={3: -100.0}, allowed_token_ids=[3, 20]),
    ]
    tokens, _ = _sample(logits, params)
    assert tokens[0] == 5
    assert tokens[1] in (11, 12)
    assert tokens[2] == 20
    sampled, _ = _sample(torch.randn(64, VOCAB), [SamplingParams(allowed_token_ids=[2, 30])] * 64)
    assert set(sampled) <= {2, 30}


def test_bad_words_block_the_last_token_only_after_their_prefix():
    words = [[3], [8, 9, 10]]
    assert banned_by_bad_words(words, [1, 2]) == [3]
    assert banned_by_bad_words(words, [8, 9]) == [3, 10]
    assert banned_by_bad_words(words, [9]) == [3]  # the prefix is two tokens
    logits = _peaked(10)
    logits[0, 3] = 11.0
    params = SamplingParams(temperature=0, bad_words=["x"], bad_words_token_ids=words)
    tokens, _ = _sample(logits.clone(), [params], outputs=[8, 9])
    assert tokens[0] not in (3, 10)
    tokens, _ = _sample(logits.clone(), [params], outputs=[8, 8])
    assert tokens == [10]


def _sample_masked(logits, params_list, bitmask, outputs=()):
    states = [
        RequestState.from_new(NewRequestData(str(i), [1, 2, *outputs], 2, p, ([0],), 0))
        for i, p in enumerate(params_list)
    ]
    batch = build_sampling_batch(states, EOS)
    batch.token_bitmask = bitmask
    return Sampler(torch.Generator().manual_seed(0))(logits, batch)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_complete_grammar_outranks_min_tokens_and_a_refused_row_is_reported(temperature):
    """Row 0: its grammar allows only EOS while min_tokens holds EOS back: EOS is sampled
    (the grammar wins, as in vLLM). Row 1: no grammar, allowed_token_ids all bad words: no
    token is left, and the row is reported instead of sampling a masked token. Row 2: free."""
    logits = _peaked(3, 3)
    bitmask = torch.full((3, 2), -1, dtype=torch.int32)
    bitmask[0] = 0
    bitmask[0, 0] = 1 << EOS[0]
    params = [
        SamplingParams(temperature=temperature, min_tokens=4),
        SamplingParams(
            temperature=temperature, allowed_token_ids=[5], bad_words=["x"], bad_words_token_ids=[[5]]
        ),
        SamplingParams(temperature=temperature, min_tokens=4),
    ]
    out = _sample_masked(logits, params, bitmask, outputs=[9])
    assert out.tokens[0] == EOS[0]
    assert out.tokens[2] == 3
    assert out.refused_rows == [1]


def test_contradictory_allowed_token_ids_are_refused_up_front():
    stops_only = SamplingParams(allowed_token_ids=[7, 9], stop_token_ids=[9], min_tokens=2)
    with pytest.raises(InvalidRequestError) as err:
        check_some_token_allowed(stops_only, EOS)
    assert err.value.param == "min_tokens"
    bad_only = SamplingParams(allowed_token_ids=[5], bad_words=["x"], bad_words_token_ids=[[5]])
    with pytest.raises(InvalidRequestError) as err:
        check_some_token_allowed(bad_only, EOS)
    assert err.value.param == "allowed_token_ids"
    check_some_token_allowed(
        SamplingParams(allowed_token_ids=[7, 9], stop_token_ids=[9]), EOS
    )  # no min_tokens
    check_some_token_allowed(SamplingParams(allowed_token_ids=[7], min_tokens=2, ignore_eos=True), EOS)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logit_bias": {3: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_impossible_values_name_their_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def _hf_min_new_tokens(model, prompt, eos_ids, min_new, max_new):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        eos_token_id=eos_ids,
        pad_token_id=0,
        do_sample=False,
    )[0, len(prompt) :].tolist()
    for i, token in enumerate(out):
        if token in eos_ids:
            return out[: i + 1]
    return out


@pytest.mark.slow
def test_greedy_min_tokens_equals_hf_min_new_tokens(tiny_llama):
    """A stop token the unconstrained answer hits early: min_tokens keeps it (and EOS) out
    for N tokens exactly as HF's min_new_tokens does, and the answer is no shorter than N."""
    llm = make_llm(tiny_llama)
    prompts = tokenize_all(tiny_llama, PROMPT_TEXTS[:3])
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    eos = list(llm.config.model.eos_token_ids)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, free):
        stop = out.outputs[0].token_ids[1]  # would end the answer at its second token
        params = SamplingParams(temperature=0, max_tokens=12, min_tokens=5, stop_token_ids=[stop])
        got = llm.generate(prompt, params)[0].outputs[0]
        assert len(got.token_ids) >= 5
        assert got.token_ids == _hf_min_new_tokens(hf, prompt, [*eos, stop], 5, 12)
    assert_pool_full(llm)


@pytest.mark.slow
def test_min_tokens_is_never_cut_short_by_stops(tiny_llama):
    llm = make_llm(tiny_llama)
    prompts = tokenize_all(tiny_llama, PROMPT_TEXTS[:4])
    vocab = llm.config.model.vocab_size
    eos = list(llm.config.model.eos_token_ids)
    # EOS made very likely, and a stop string of one common character
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=10, min_tokens=6, logit_bias={t: 30.0 for t in eos}, stop=["e"]
    )
    for out in llm.generate(prompts, params):
        assert len(out.outputs[0].token_ids) >= 6, out.outputs[0]
    short = SamplingParams(temperature=1.0, seed=3, max_tokens=10, logit_bias={t: 30.0 for t in eos})
    assert all(len(o.outputs[0].token_ids) < 6 for o in llm.generate(prompts, short))  # bias works
    assert all(t < vocab for t in eos)
    assert_pool_full(llm)
