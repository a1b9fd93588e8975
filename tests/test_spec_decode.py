"""Speculative decoding by prompt lookup (kvferry.spec_decode): the same tokens as plain
decoding, in fewer forwards.

Every engine test compares against an engine without drafts on the same model and asserts
that drafts were kept and that fewer forwards ran, so a run that silently stops drafting
(or verifies nothing) fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.config import CaptureMode, EngineOptions
from kvferry.engine.llm import LLM
from kvferry.errors import ConfigError
from kvferry.kv.spec import Layout
from kvferry.model.forward_context import AttentionMetadata
from kvferry.model.microbatch import _boundaries
from kvferry.sampling_params import SamplingParams
from kvferry.spec_decode.config import SpeculativeConfig, SpeculativeMethod
from kvferry.spec_decode.ngram import propose_ngram
from kvferry.spec_decode.verify import accepted_tokens
from tests.engine_helpers import assert_pool_full, make_llm

NGRAM = SpeculativeConfig(SpeculativeMethod.NGRAM, num_speculative_tokens=3)
# Prompts whose answers (on the tiny models) repeat earlier runs of tokens, and one that
# does not; ids only, as every tiny model shares the vocabulary.
LOOPING = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],
    [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41],
    list(range(20, 60)),
]


# ---- the proposer and the acceptance rule ------------------------------------------------


def test_ngram_takes_the_longest_match_and_its_latest_full_occurrence():
    # "3 4" occurs twice before the end; the 3-gram "2 3 4" only once, first: it wins
    assert propose_ngram([1, 2, 3, 4, 9, 9, 7, 3, 4, 8, 2, 3, 4], 2, 2, 3) == [9, 9]
    # only 2-grams match: the latest occurrence's continuation
    assert propose_ngram([3, 4, 5, 6, 3, 4, 7, 1, 3, 4], 3, 2, 3) == [7, 1, 3]
    # fewer tokens follow the match than asked: what there is
    assert propose_ngram([1, 2, 3, 1, 2], 5, 2, 2) == [3, 1, 2]
    # a run of one token: the latest occurrence has one token after it, the earliest more
    assert propose_ngram([4, 8, 8, 8, 8, 8], 3, 2, 2) == [8, 8, 8]
    # the latest occurrence with enough tokens after it beats an earlier one
    assert propose_ngram([1, 2, 5, 6, 1, 2, 7, 8, 9, 1, 2], 2, 2, 2) == [7, 8]


def test_ngram_without_a_match_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4, 5], 3, 2, 4) == []
    assert propose_ngram([7, 7], 3, 2, 4) == []  # too short for a 2-gram with a successor
    assert propose_ngram([1, 2, 1, 2], 0, 1, 2) == []


def test_acceptance_keeps_drafts_up_to_the_first_disagreement():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all kept, one more
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # rows after a miss are void
    assert accepted_tokens([5, 6, 7], [4, 6, 7, 8]) == [4]


# ---- configuration ---------------------------------------------------------------------------


def test_the_option_takes_vllms_keys_and_refuses_nonsense():
    options = EngineOptions("m", speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert options.speculative_config == SpeculativeConfig(SpeculativeMethod.NGRAM, 5)
    assert not EngineOptions("m").speculative_config.enabled
    bad = [
        ({"method": "eagle", "num_speculative_tokens": 2}, "unknown method"),
        ({"method": "ngram"}, "num_speculative_tokens must be a positive integer"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown keys"),
        ({"num_speculative_tokens": 2}, "say which method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min"),
        ("{not json", "not valid JSON"),
    ]
    for raw, message in bad:
        with pytest.raises(ConfigError, match=message):
            SpeculativeConfig.from_value(raw)


def test_a_batch_is_never_cut_between_a_token_and_its_drafts():
    import torch

    # rows 0-3: one request and its 3 drafts; row 4: a plain decode; rows 5-6: another's
    attn = AttentionMetadata(
        slot_mapping=torch.zeros(7, dtype=torch.int64),
        num_decodes=7,
        decode_block_table=torch.zeros(7, 1, dtype=torch.int64),
        decode_seq_lens=torch.ones(7, dtype=torch.int64),
        decode_request_starts=(0, 4, 5),
    )
    assert _boundaries(attn, 7) == [0, 4, 5, 7]


# ---- engines ---------------------------------------------------------------------------------


def _generate(llm: LLM, params: SamplingParams | list[SamplingParams], prompts=LOOPING):
    inputs = [{"prompt_token_ids": p} for p in prompts]
    return llm.generate(inputs, params)


def _forwards(llm: LLM) -> int:
    (stats,) = llm.engine.executor.capture_stats()
    return stats.compiled_steps + stats.eager_steps


def _compare(model_dir: Path, params, prompts=LOOPING, **options) -> tuple[list, list, LLM]:
    """(plain outputs, drafted outputs, the drafting engine), each engine's pool checked full.
    A kept draft is a token its request got without a step of its own."""
    plain_llm = make_llm(model_dir, **options)
    spec_llm = make_llm(model_dir, speculative=NGRAM, **options)
    plain = _generate(plain_llm, params, prompts)
    drafted = _generate(spec_llm, params, prompts)
    drafts = spec_llm.engine.scheduler.drafts
    assert drafts is not None and drafts.num_accepted_tokens > 0, "no draft was kept"
    for llm in (plain_llm, spec_llm):
        assert_pool_full(llm)
    return plain, drafted, spec_llm


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_tokens_and_logprobs_equal_plain_decoding(tiny_llama):
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=2)
    plain, drafted, _ = _compare(tiny_llama, params)
    assert _tokens(drafted) == _tokens(plain)
    for a, b in zip(plain, drafted):  # the same logits rows: the same numbers
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_a_looping_answer_takes_fewer_forwards(tiny_llama):
    """Every kept draft is a token without a forward of its own: 40 tokens take 40
    forwards plainly (the prompt's gives the first), and 40 minus the kept drafts drafted."""
    counts = []
    for llm in (make_llm(tiny_llama), make_llm(tiny_llama, speculative=NGRAM)):
        before = _forwards(llm)
        (out,) = _generate(llm, SamplingParams(max_tokens=40, temperature=0.0), LOOPING[:1])
        counts.append(_forwards(llm) - before)
        assert len(out.outputs[0].token_ids) == 40
    kept = llm.engine.scheduler.drafts.num_accepted_tokens
    assert kept > 0
    assert counts == [40, 40 - kept]


def test_seeded_sampling_draws_the_same_tokens(tiny_llama):
    params = [
        SamplingParams(max_tokens=40, temperature=0.3, top_p=0.9, seed=11),
        SamplingParams(max_tokens=40, temperature=0.5, top_k=20, seed=12),
        SamplingParams(max_tokens=40, temperature=0.0),
    ]
    plain, drafted, _ = _compare(tiny_llama, params)
    assert _tokens(drafted) == _tokens(plain)


def test_requests_that_cannot_be_drafted_for_share_the_batch(tiny_llama):
    """Penalties, a grammar-free constraint and min_tokens change the logits token by
    token: such requests decode plainly beside drafted ones, all equal to plain."""
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(max_tokens=30, temperature=0.0, min_tokens=30),
        SamplingParams(max_tokens=30, temperature=0.0),
    ]
    plain, drafted, _ = _compare(tiny_llama, params)
    assert _tokens(drafted) == _tokens(plain)


def test_a_stop_inside_the_kept_drafts_ends_the_answer_there(tiny_llama):
    probe = _tokens(_generate(make_llm(tiny_llama), SamplingParams(max_tokens=24, temperature=0.0)))
    stop = probe[1][12]  # a token the looping answer reaches mid-way
    params = [
        SamplingParams(max_tokens=7, temperature=0.0),  # max_tokens falls inside a draft run
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop]),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    ]
    plain, drafted, _ = _compare(tiny_llama, params)
    assert _tokens(drafted) == _tokens(plain)
    assert len(drafted[0].outputs[0].token_ids) == 7
    assert drafted[1].outputs[0].token_ids[-1] == stop and drafted[1].outputs[0].finish_reason == "stop"


def test_sliding_window_model(tiny_gemma3):
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain, drafted, _ = _compare(tiny_gemma3, params, block_size=4)
    assert _tokens(drafted) == _tokens(plain)


def test_hnd_layout_and_small_blocks(tiny_qwen2):
    """Draft rows crossing block boundaries, in the other KV layout."""
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain, drafted, _ = _compare(tiny_qwen2, params, block_size=2, kv_layout=Layout.HND)
    assert _tokens(drafted) == _tokens(plain)


def test_verifying_steps_run_in_the_captured_forward(tiny_llama):
    """A token and its drafts attend as decode rows: the step stays decode-only, and the
    compiled program runs it (only the prompts' step is eager)."""
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain_llm = make_llm(tiny_llama, capture=CaptureMode.ALWAYS)
    spec_llm = make_llm(tiny_llama, capture=CaptureMode.ALWAYS, speculative=NGRAM)
    (before,) = spec_llm.engine.executor.capture_stats()
    eager_before, compiled_before = before.eager_steps, before.compiled_steps
    assert _tokens(_generate(spec_llm, params)) == _tokens(_generate(plain_llm, params))
    (after,) = spec_llm.engine.executor.capture_stats()
    assert after.eager_steps - eager_before == 1
    assert after.compiled_steps - compiled_before > 0
    assert spec_llm.engine.scheduler.drafts.num_accepted_tokens > 0


def test_a_pd_decoder_drafts_on_the_kv_it_pulled(tiny_qwen2):
    """P/D over real NIXL agents: the decoder's answer, drafted, equals a colocated plain
    engine's; both pools end full."""
    import dataclasses
    import time

    from kvferry.config import KVTransferConfig
    from kvferry.engine.core import EngineCore
    from kvferry.messages.engine_core import EngineCoreRequest
    from tests.test_nixl_engine import _config, _drain, _run

    kv = KVTransferConfig("NixlConnector", kv_role="both", kv_connector_extra_config={"lease_s": 20})
    prefiller = EngineCore(_config(tiny_qwen2, kv, "NHD"))
    decoder = EngineCore(dataclasses.replace(_config(tiny_qwen2, kv, "HND"), speculative=NGRAM))
    colocated = EngineCore(_config(tiny_qwen2, None, "NHD"))
    try:
        one, params = (
            SamplingParams(max_tokens=1, temperature=0),
            SamplingParams(max_tokens=24, temperature=0),
        )
        now = time.time()
        first = [
            EngineCoreRequest(f"p{i}", p, one, now, {"do_remote_decode": True}) for i, p in enumerate(LOOPING)
        ]
        _, prefilled = _run(prefiller, first, decoder)
        pulled = [
            EngineCoreRequest(f"d{i}", p, params, now, prefilled[f"p{i}"].kv_transfer_params)
            for i, p in enumerate(LOOPING)
        ]
        decoded, _ = _run(decoder, pulled, prefiller)
        expected, _ = _run(
            colocated, [EngineCoreRequest(f"c{i}", p, params, now) for i, p in enumerate(LOOPING)]
        )
        assert [decoded[f"d{i}"] for i in range(len(LOOPING))] == [
            expected[f"c{i}"] for i in range(len(LOOPING))
        ]
        assert decoder.stats().kv_connector["nixl_transfers"] == len(LOOPING)
        assert decoder.scheduler.drafts is not None and decoder.scheduler.drafts.num_accepted_tokens > 0
        _drain(prefiller, decoder)
    finally:
        for core in (prefiller, decoder, colocated):
            core.shutdown()


def test_a_request_whose_drafts_miss_waits_longer_each_time():
    from kvferry.scheduler.drafts import MAX_BACKOFF_TOKENS, DraftProposer
    from kvferry.scheduler.request import Request

    request = Request("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=100, temperature=0.0), [0], 512)
    request.append_output_token_ids(3)
    proposer = DraftProposer(NGRAM, max_model_len=512)
    assert proposer.propose(request, token_budget=64) == [1, 2, 3]
    waits = []
    for _ in range(7):  # every draft missed: the request waits 1, 2, 4, ... output tokens
        proposer.record(request, 3, 0)
        waits.append(request.drafts_resume_at - request.num_output_tokens - 1)
    assert waits == [1, 2, 4, 8, 16, MAX_BACKOFF_TOKENS, MAX_BACKOFF_TOKENS]
    assert proposer.propose(request, token_budget=64) == []  # still waiting
    request.append_output_token_ids([1, 2, 3] * 6)  # past the wait
    assert proposer.propose(request, token_budget=64) == [1, 2, 3]
    proposer.record(request, 3, 1)  # a kept draft ends the backoff
    assert request.draft_misses == 0
    assert (proposer.num_draft_tokens, proposer.num_accepted_tokens) == (24, 1)


def test_preempted_drafting_requests_resume_with_the_same_tokens(tiny_llama):
    """A cache too small for every request: drafted requests are preempted (their drafts
    dropped with their blocks) and recomputed, and still answer as plain decoding."""
    prompts = LOOPING + [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7], [50, 51, 52, 50, 51, 52, 50]]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain, drafted, spec_llm = _compare(tiny_llama, params, prompts, num_blocks=10, block_size=8)
    assert _tokens(drafted) == _tokens(plain)
    assert spec_llm.stats().num_preemptions > 0
