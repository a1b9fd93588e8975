"""LLM.generate's prompt forms: text, token ids, and the dicts vLLM users pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.errors import InvalidRequestError
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import assert_pool_full, make_llm, tokenize_all

GREEDY = SamplingParams(max_tokens=6, temperature=0)
TEXT = "The river runs past the old stone bridge"


def _tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def test_dict_prompts_mean_what_they_say(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    ids = tokenize_all(tiny_llama, [TEXT])[0]
    expected = _tokens(llm.generate(ids, GREEDY))
    by_ids = llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert by_ids[0].prompt_token_ids == ids and _tokens(by_ids) == expected
    assert _tokens(llm.generate({"prompt": TEXT}, GREEDY)) == _tokens(llm.generate(TEXT, GREEDY))
    mixed = llm.generate([{"prompt_token_ids": ids}, ids, {"prompt": TEXT}], GREEDY)
    assert _tokens(mixed)[:2] == expected * 2
    assert_pool_full(llm)


@pytest.mark.parametrize(
    "bad", [{"prompt_ids": [1, 2]}, {"prompt": "a", "prompt_token_ids": [1]}, {}, {"prompt_token_ids": "12"}]
)
def test_malformed_prompt_dicts_are_refused_before_anything_runs(tiny_llama: Path, bad: dict) -> None:
    llm = make_llm(tiny_llama)
    with pytest.raises(InvalidRequestError):
        llm.generate([{"prompt": "fine"}, bad], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert_pool_full(llm)
