"""--prefill-budget-with-decodes: while requests decode, one step computes at most that many
prompt tokens, so a long prompt arriving mid-generation is spread over several steps
instead of stalling the decodes for a whole max_num_batched_tokens step; greedy outputs
are unchanged."""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvferry.config import SchedulerConfig
from kvferry.engine.core import describe_step_budget
from kvferry.errors import ConfigError
from kvferry.messages.engine_core import EngineCoreRequest
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import assert_pool_full, make_llm

BUDGET = 48
LONG = 300


def _run(tiny_llama, budget: int) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """Three short requests decode, then a long prompt arrives: the tokens per request and,
    per step, (prompt tokens scheduled, decodes scheduled)."""
    llm = make_llm(tiny_llama, enforce_eager=True)
    scheduler = llm.engine.scheduler
    scheduler.config = dataclasses.replace(scheduler.config, prefill_budget_with_decodes=budget)
    steps: list[tuple[int, int]] = []
    schedule = scheduler.schedule

    def recorded():
        out = schedule()
        chunks = [n for n in out.num_scheduled_tokens.values() if n > 1]
        steps.append((sum(chunks), len(out.num_scheduled_tokens) - len(chunks)))
        return out

    scheduler.schedule = recorded
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i in range(3):
        llm.engine.add_request(EngineCoreRequest(f"short{i}", [5 + i, 6, 7, 8], greedy, time.time()))
    tokens: dict[str, list[int]] = {}
    for step in range(200):
        if step == 3:
            long_prompt = [(11 * j) % 90 + 3 for j in range(LONG)]
            llm.engine.add_request(EngineCoreRequest("long", long_prompt, greedy, time.time()))
        for out in llm.engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        if step > 3 and not llm.engine.has_unfinished_requests():
            break
    assert_pool_full(llm)
    return tokens, steps


def test_prompt_tokens_are_capped_while_requests_decode(tiny_llama):
    capped_tokens, capped = _run(tiny_llama, BUDGET)
    free_tokens, free = _run(tiny_llama, SchedulerConfig.max_num_batched_tokens)
    assert capped_tokens == free_tokens
    assert all(prompt <= BUDGET for prompt, decodes in capped if decodes)
    assert sum(prompt for prompt, _ in capped) == sum(prompt for prompt, _ in free)
    assert any(prompt > BUDGET for prompt, decodes in free if decodes)  # the cap did something


def test_a_budget_caps_by_default_and_one_as_large_as_the_step_caps_nothing():
    assert SchedulerConfig().caps_prefill_with_decodes
    assert not SchedulerConfig(
        max_num_batched_tokens=64, prefill_budget_with_decodes=128
    ).caps_prefill_with_decodes
    assert not SchedulerConfig(enable_chunked_prefill=False).caps_prefill_with_decodes
    with pytest.raises(ConfigError, match="prefill budget"):
        SchedulerConfig(prefill_budget_with_decodes=0)


def test_the_start_up_log_states_the_budget():
    assert describe_step_budget(SchedulerConfig()).endswith("at most 256 prompt tokens while requests decode")
    off = SchedulerConfig(prefill_budget_with_decodes=2048)
    assert describe_step_budget(off).endswith("prompt tokens not capped while requests decode")


def test_the_cli_help_states_the_configs_default():
    import argparse

    from kvferry.entrypoints.engine_args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    (action,) = [a for a in parser._actions if "--prefill-budget-with-decodes" in a.option_strings]
    assert f"default {SchedulerConfig().prefill_budget_with_decodes};" in action.help
