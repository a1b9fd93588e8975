"""Sampler unit tests: greedy, filters, penalties, seeds, logprobs."""

import pytest
import torch

from kvferry.messages.scheduler_output import NewRequestData
from kvferry.sampling_params import SamplingParams
from kvferry.worker.request_state import RequestState, build_sampling_batch
from kvferry.worker.sampler import Sampler, apply_top_k_top_p, sample_inverse_cdf
from kvferry.worker.seeded_draws import position_draws

VOCAB = 50


def _states(params_list, prompt=(1, 2, 3), outputs=()):
    states = []
    for i, params in enumerate(params_list):
        data = NewRequestData(str(i), list(prompt) + list(outputs), len(prompt), params, ([0],), 0)
        states.append(RequestState.from_new(data))
    return states


def _sample(logits, states, seed=0):
    sampler = Sampler(torch.Generator().manual_seed(seed))
    out = sampler(logits, build_sampling_batch(states))
    return out.tokens, out.logprobs


def test_greedy_is_argmax():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    tokens, _ = _sample(logits, _states([SamplingParams(temperature=0)] * 4))
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_pick_the_argmax():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=5.0, top_k=1), SamplingParams(temperature=5.0, top_p=1e-6)]
    for seed in range(5):
        tokens, _ = _sample(logits, _states(params), seed)
        assert tokens == logits.argmax(-1).tolist()


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 7], logits[0, 9] = 5.0, 4.9
    seen = set()
    for seed in range(30):
        tokens, _ = _sample(logits, _states([SamplingParams(temperature=10.0, min_p=0.5)]), seed)
        seen.add(tokens[0])
    assert seen == {7, 9}


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1] + [1e-9] * (VOCAB - 3)]))
    counts = torch.zeros(VOCAB)
    sampler = Sampler(torch.Generator().manual_seed(3))
    states = _states([SamplingParams(temperature=1.0)])
    for _ in range(2000):
        tokens = sampler(logits, build_sampling_batch(states)).tokens
        counts[tokens[0]] += 1
    freq = counts[:3] / 2000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_tokens_outside_top_k_or_of_probability_zero_are_never_drawn():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(11))
    logits[3, 5:] = float("-inf")  # only tokens 0..4 possible
    sampler = Sampler(torch.Generator().manual_seed(12))
    params = [SamplingParams(temperature=2.0, top_k=3)] * 3 + [SamplingParams(temperature=5.0)]
    states = _states(params)
    allowed = [set(logits[row].topk(3).indices.tolist()) for row in range(3)] + [set(range(5))]
    seen: list[set[int]] = [set() for _ in range(4)]
    for _ in range(500):
        tokens = sampler(logits, build_sampling_batch(states)).tokens
        for row, token in enumerate(tokens):
            assert token in allowed[row]
            seen[row].add(token)
    assert seen == allowed  # and every allowed token does come up


def test_inverse_cdf_picks_the_token_whose_interval_holds_the_draw():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25]] * 5)
    draws = torch.tensor([[0.0], [0.2499], [0.25], [0.7501], [0.999999]], dtype=torch.float64)
    assert sample_inverse_cdf(probs, draws).tolist() == [1, 1, 3, 4, 4]


def _reference_top_k_top_p(logits, top_k, top_p):
    """The filter by its definition: whole rows sorted; p = 1 keeps the whole top-k."""
    out = logits.clone()
    for row in range(logits.shape[0]):
        values, order = logits[row].sort(descending=True)
        k = int(top_k[row]) or logits.shape[1]
        probs = torch.softmax(values[:k], dim=-1)
        kept = int(((probs.cumsum(0) - probs) < top_p[row]).sum()) if top_p[row] < 1 else k
        out[row, order[kept:]] = float("-inf")
    return out


@pytest.mark.parametrize("head_size", [4, 64, 4096])
def test_top_k_top_p_on_a_sorted_head_equals_the_full_sort(head_size: int):
    gen = torch.Generator().manual_seed(13)
    sharp = torch.randn(6, 300, generator=gen) * 8  # nucleus inside a small head
    flat = torch.randn(6, 300, generator=gen) * 0.1  # nucleus past it: full-sort fallback
    logits = torch.cat([sharp, flat])
    top_k = torch.tensor([0, 3, 0, 200, 0, 50] * 2)
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.5, 0.99, 0.7] * 2)
    got = apply_top_k_top_p(logits, top_k, top_p, head_size=head_size)
    assert torch.equal(torch.isinf(got), torch.isinf(_reference_top_k_top_p(logits, top_k, top_p)))
    kept = ~torch.isinf(got)
    assert torch.equal(got[kept], logits[kept])
    assert bool(kept[2].all()) and bool(kept[8].all())  # no filter: every token stays


def test_seeded_request_is_reproducible_whatever_the_batch():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_params, batch_logits, row, engine_seed):
        sampler = Sampler(torch.Generator().manual_seed(engine_seed))
        states = _states(batch_params)
        tokens = []
        for _ in range(10):
            sampled = sampler(batch_logits, build_sampling_batch(states)).tokens
            for state, token in zip(states, sampled):
                state.token_ids.append(token)
            tokens.append(sampled[row])
        return tokens

    alone = run([seeded], logits[2:], 0, engine_seed=0)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)]
    mixed = run([*others, seeded], logits, 2, engine_seed=99)
    assert alone == mixed
    assert len(set(alone)) > 1  # it really samples


def test_resumed_seeded_request_continues_its_stream():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, seed=7)
    full = _decode(Sampler(torch.Generator().manual_seed(0)), logits, _states([params])[0], 6)
    resumed = _states([params], outputs=full[:3])[0]  # preempted after 3 tokens
    assert _decode(Sampler(torch.Generator().manual_seed(1)), logits, resumed, 3) == full[3:]
    # continued as a new request whose prompt holds the tokens so far (a decode failover)
    continued = _states([params], prompt=(1, 2, 3, *full[:3]))[0]
    assert _decode(Sampler(torch.Generator().manual_seed(2)), logits, continued, 3) == full[3:]
    assert len(set(full)) > 1  # it really samples


def test_seeded_draw_depends_on_the_position_not_on_the_draws_before_it():
    """Position p's draw is the same after any history: a fresh request whose sequence is
    already p tokens long draws what a request that sampled its way there draws."""
    params = SamplingParams(temperature=1.0, seed=99)
    long_prompt = _states([params], prompt=tuple(range(1, 9)))[0]
    short_prompt_sampled = _states([params], prompt=(1, 2), outputs=(3, 4, 5, 6, 7, 8))[0]
    batch = build_sampling_batch([long_prompt, short_prompt_sampled])
    assert batch.positions == [8, 8] and batch.seeds == [99, 99]
    draws = position_draws([99, 99, 99, 100], [8, 8, 9, 8])
    assert draws[0] == draws[1] and len(set(draws.tolist())) == 3
    assert torch.equal(position_draws([99], [8]), draws[:1])  # no hidden state between calls
    logits = torch.zeros(2, VOCAB)  # uniform: the token is floor(draw * VOCAB)
    tokens, _ = _sample(logits, [long_prompt, short_prompt_sampled])
    assert tokens == [int(draws[0] * VOCAB)] * 2


def test_position_draws_are_uniform_and_distinct_per_seed():
    draws = position_draws([5] * 20000, range(20000))
    assert 0 <= float(draws.min()) and float(draws.max()) < 1
    assert abs(float(draws.mean()) - 0.5) < 0.01 and abs(float(draws.std()) - 12**-0.5) < 0.01
    other_seed = position_draws([6] * 20000, range(20000))
    assert abs(float(torch.corrcoef(torch.stack([draws, other_seed]))[0, 1])) < 0.03
    extremes = position_draws([-(2**63), -1, 2**63 - 1], [0, 0, 0])  # the whole int64 range
    assert len(set(extremes.tolist())) == 3


def test_repetition_and_frequency_penalties_move_away_from_seen_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 2.0, 1.9
    plain, _ = _sample(logits, _states([SamplingParams(temperature=0)], prompt=(5,)))
    assert plain == [5]
    rep, _ = _sample(logits, _states([SamplingParams(temperature=0, repetition_penalty=1.5)], prompt=(5,)))
    assert rep == [6]
    freq, _ = _sample(
        logits, _states([SamplingParams(temperature=0, frequency_penalty=0.1)], prompt=(1,), outputs=(5, 5))
    )
    assert freq == [6]
    pres, _ = _sample(
        logits, _states([SamplingParams(temperature=0, presence_penalty=0.2)], prompt=(1,), outputs=(5,))
    )
    assert pres == [6]


def test_logprobs_of_sampled_token_and_top_alternatives():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(6))
    tokens, logprobs = _sample(
        logits, _states([SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)])
    )
    ref = torch.log_softmax(logits, -1)
    assert logprobs[1] is None
    assert abs(logprobs[0].sampled - ref[0, tokens[0]].item()) < 1e-5
    top_ids = [tok for tok, _ in logprobs[0].top]
    assert top_ids == ref[0].topk(3).indices.tolist()
    assert top_ids[0] == tokens[0]


# ---- forced first token (a P/D decoder outputs the prefiller's token) ----------------------


def _forced_state(params, forced, prompt=(1, 2, 3), outputs=()):
    data = NewRequestData("f", list(prompt) + list(outputs), len(prompt), params, ([0],), 0, forced)
    return RequestState.from_new(data)


def _decode(sampler, logits, state, steps):
    """Sample `steps` tokens for one request, appending each (as the model runner does)."""
    tokens = []
    for _ in range(steps):
        (token,) = sampler(logits, build_sampling_batch([state])).tokens
        state.token_ids.append(token)
        tokens.append(token)
    return tokens


def test_forced_token_replaces_the_first_sample_only():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(7))
    states = _states([SamplingParams(temperature=0), SamplingParams(temperature=0.8)])
    states.insert(1, _forced_state(SamplingParams(temperature=0), forced=11))
    tokens, _ = _sample(logits, states)
    assert tokens[1] == 11 and tokens[0] == logits[0].argmax().item()
    states[1].token_ids.append(11)
    tokens, _ = _sample(logits, states)
    assert tokens[1] == logits[1].argmax().item()  # only the first token is forced


def test_forced_seeded_token_keeps_the_later_draws_aligned():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(8))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=42)
    free = _states([params])[0]
    sampled = _decode(Sampler(torch.Generator().manual_seed(0)), logits, free, 6)
    other = next(t for t in range(VOCAB) if t != sampled[0])
    forced = _forced_state(params, forced=other)
    first = _decode(Sampler(torch.Generator().manual_seed(1)), logits, forced, 1)
    rest = _decode(Sampler(torch.Generator().manual_seed(3)), logits, forced, 5)
    assert [*first, *rest] == [other, *sampled[1:]]  # the seeded stream stays aligned
    assert len(set(sampled)) > 1  # it really samples


def test_forced_token_logprobs_are_this_engines():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(9))
    ref = torch.log_softmax(logits, -1)[0]
    forced = int(ref.argmin())
    state = _forced_state(SamplingParams(temperature=0.8, logprobs=2), forced=forced)
    tokens, logprobs = _sample(logits, [state])
    assert tokens == [forced]
    assert abs(logprobs[0].sampled - ref[forced].item()) < 1e-5
    assert [tok for tok, _ in logprobs[0].top] == ref.topk(2).indices.tolist()


def test_forced_token_counts_as_output_for_penalties():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 2.0, 1.9
    state = _forced_state(SamplingParams(temperature=0, frequency_penalty=0.2), forced=5, prompt=(1,))
    assert _decode(Sampler(torch.Generator().manual_seed(0)), logits, state, 2) == [5, 6]


def test_resumed_request_is_not_forced_again():
    params = SamplingParams(temperature=0.8, seed=3)
    resumed = _forced_state(params, forced=11, outputs=(11, 4))  # preempted after two tokens
    assert resumed.forced_token_id is None
    assert build_sampling_batch([resumed]).forced_token_ids is None
