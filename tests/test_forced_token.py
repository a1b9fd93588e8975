"""A forced first token through the real engine (tiny llama, in process): the token a
connector forces is the first output; everything after it, seeded draws included, matches
a run that sampled that token itself. The connector is tests/connectors/forcing.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.config import KVTransferConfig
from kvferry.engine.llm import LLM
from kvferry.outputs import CompletionOutput
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm

FORCING = KVTransferConfig(
    kv_connector="ForcingConnector", kv_connector_module_path="tests.connectors.forcing"
)
SEEDS = (0, 1, 7, 1234)


@pytest.fixture(scope="module")
def engines(tiny_llama: Path) -> dict[str, LLM]:
    return {"plain": make_llm(tiny_llama), "forcing": make_llm(tiny_llama, kv_transfer=FORCING)}


def _forced(llm: LLM, prompts: list[str], params: list[SamplingParams], firsts: list[int]) -> list:
    """llm.generate, each request carrying its first token in kv_transfer_params."""
    ids = []
    for i, (prompt, p, first) in enumerate(zip(prompts, params, firsts, strict=True)):
        request = llm.inputs.process(f"forced-{i}", prompt, p, {"first_token_id": first})
        llm.outputs.add_request(request.req_id, prompt, request.prompt_token_ids, p)
        llm.engine.add_request(request)
        ids.append(request.req_id)
    return [out.outputs[0] for out in llm._run(ids)]


def _same(a: CompletionOutput, b: CompletionOutput) -> None:
    assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert [[t for t, _ in lp.top] for lp in a.logprobs] == [[t for t, _ in lp.top] for lp in b.logprobs]
    assert _values(a) == pytest.approx(_values(b), abs=1e-5)


def _values(out: CompletionOutput) -> list[float]:
    return [v for lp in out.logprobs for v in (lp.sampled, *(v for _, v in lp.top))]


def test_forcing_the_token_it_would_sample_changes_nothing(engines: dict[str, LLM]) -> None:
    """Seeded sampling, penalties and logprobs: one draw is spent on the forced token."""
    prompts = PROMPT_TEXTS[:8]
    for seed in SEEDS:
        params = [
            SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=seed + i, logprobs=2,
                           frequency_penalty=0.5 if i % 2 else 0.0)
            for i in range(len(prompts))
        ]  # fmt: skip
        reference = [o.outputs[0] for o in engines["plain"].generate(prompts, params)]
        firsts = [ref.token_ids[0] for ref in reference]
        for ref, got in zip(reference, _forced(engines["forcing"], prompts, params, firsts), strict=True):
            _same(got, ref)
    assert_pool_full(engines["forcing"])


def test_a_forced_token_is_output_whatever_is_sampled(engines: dict[str, LLM]) -> None:
    prompt = PROMPT_TEXTS[1]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=0)
    greedy = engines["plain"].generate(prompt, params)[0].outputs[0]
    other = (greedy.token_ids[0] + 1) % engines["forcing"].config.model.vocab_size
    (forced,) = _forced(engines["forcing"], [prompt], [params], [other])
    assert forced.token_ids[0] == other and len(forced.token_ids) == 6
    # What follows continues the forced token: greedy on the prompt plus that token.
    prompt_ids = engines["plain"].get_tokenizer().encode(prompt)
    rest = engines["plain"].generate([prompt_ids + [other]], SamplingParams(max_tokens=5, temperature=0))
    assert forced.token_ids[1:] == rest[0].outputs[0].token_ids
    assert forced.logprobs[0].sampled < greedy.logprobs[0].sampled  # this engine's logprob of it
    assert_pool_full(engines["forcing"])
