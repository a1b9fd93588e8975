"""Structured outputs on the offline engine (the tiny random llama, whose unconstrained
output is gibberish): JSON-schema answers parse and validate, greedy and sampled; regex and
choice answers match; bad specs are refused naming the field; masks and grammar cache."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from kvferry.engine.llm import LLM
from kvferry.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvferry.errors import InvalidRequestError
from kvferry.sampling_params import SamplingParams
from kvferry.structured.backend import apply_token_bitmask
from kvferry.structured.params import StructuredOutputsParams
from tests.engine_helpers import assert_pool_full
from tests.tiers import first_fast

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["Hello", "The cat sees a small bird", "What is the capital of France?", "Count from 3 to ten."]
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe later"]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), kv_cache_bytes=8 << 20, enforce_eager=True)


def _texts(llm: LLM, params: SamplingParams, prompts: list[str] = PROMPTS) -> list[str]:
    outs = llm.generate(prompts, params)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), [o.outputs[0] for o in outs]
    return [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("temperature", first_fast([0.0, 1.0]))
def test_json_schema_answers_validate(llm: LLM, temperature: float) -> None:
    spec = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(max_tokens=100, temperature=temperature, structured_outputs=spec)
    for text in _texts(llm, params, PROMPTS[:2]):
        jsonschema.validate(json.loads(text), SCHEMA)
    # unconstrained, the same model writes no JSON at all
    free = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, temperature=0))[0].outputs[0].text
    with pytest.raises(ValueError):
        json.loads(free)


def test_bad_grammar_fails_alone_and_complete_grammar_outranks_min_tokens(llm: LLM) -> None:
    """One batch: a grammar that passes validation without a tokenizer but names a token
    the model lacks fails only its own request; choice answers end at their EOS although
    min_tokens is not reached (the grammar allows nothing else: vLLM's rule), greedy and
    sampled; a schema answer in the same batch is unaffected."""
    choice = StructuredOutputsParams(choice=CHOICES)
    bad = StructuredOutputsParams(grammar="start: <[99999999]>")
    assert bad.validate() is None  # the front end cannot tell
    eos = set(llm.config.model.eos_token_ids)
    params = [
        SamplingParams(max_tokens=30, temperature=0, min_tokens=20, structured_outputs=choice),
        SamplingParams(max_tokens=30, temperature=1.0, seed=3, min_tokens=20, structured_outputs=choice),
        SamplingParams(max_tokens=30, temperature=0, structured_outputs=bad),
        SamplingParams(
            max_tokens=100, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
        ),
    ]
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    for out in outs[:2]:
        assert out.text in CHOICES and out.finish_reason == "stop", out
        assert out.token_ids[-1] in eos and len(out.token_ids) < 20, out
    assert outs[2].finish_reason == "error" and outs[2].token_ids == [], outs[2]
    jsonschema.validate(json.loads(outs[3].text), SCHEMA)
    assert_pool_full(llm)


@pytest.mark.slow
def test_regex_and_choice_answers_match(llm: LLM) -> None:
    regex = SamplingParams(
        max_tokens=30, temperature=1.0, seed=7, structured_outputs=StructuredOutputsParams(regex=REGEX)
    )
    assert all(re.fullmatch(REGEX, text) for text in _texts(llm, regex))
    choice = SamplingParams(
        max_tokens=30, temperature=1.0, structured_outputs=StructuredOutputsParams(choice=CHOICES)
    )
    assert all(text in CHOICES for text in _texts(llm, choice))


@pytest.mark.slow
def test_grammar_compiled_once_per_spec(llm: LLM) -> None:
    spec = StructuredOutputsParams(grammar='root ::= "red" | "green" | "blue"')
    texts = _texts(llm, SamplingParams(max_tokens=10, temperature=1.0, structured_outputs=spec))
    assert set(texts) <= {"red", "green", "blue"}
    backend = llm.engine.executor.worker.runner.grammars  # type: ignore[attr-defined]
    before = backend.num_compiled
    _texts(llm, SamplingParams(max_tokens=10, temperature=1.0, structured_outputs=spec))
    assert backend.num_compiled == before


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nosuch"}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs"),
    ],
)
def test_bad_specs_name_their_field(body: dict, param: str) -> None:
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    with pytest.raises(InvalidRequestError) as err:
        request.to_sampling_params()
    assert err.value.param == param


def test_request_forms_translate() -> None:
    def spec(body: dict) -> StructuredOutputsParams | None:
        return (
            CompletionRequest.model_validate({"prompt": "x", **body}).to_sampling_params().structured_outputs
        )

    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    assert (
        spec({"response_format": rf}) == spec({"guided_json": SCHEMA}) == StructuredOutputsParams(json=SCHEMA)
    )
    assert spec({"structured_outputs": {"json": json.dumps(SCHEMA)}}) == StructuredOutputsParams(json=SCHEMA)
    assert spec({"response_format": {"type": "json_object"}}) == StructuredOutputsParams(json_object=True)
    assert spec({"response_format": {"type": "text"}}) is None
    assert spec({"guided_choice": CHOICES}) == StructuredOutputsParams(choice=tuple(CHOICES))


def test_bitmask_refuses_unset_bits() -> None:
    logits = torch.zeros(2, 40)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 1 << 3
    mask[1, 1] = 1 << 4  # token 36
    out = apply_token_bitmask(logits, mask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [36]
