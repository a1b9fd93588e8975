"""Structured outputs over HTTP, colocated (a decode instance asked directly, as any
`kvferry serve`) and through `kvferry disagg` (the prefiller samples the first token under
the grammar, the decoder resumes the grammar after it): every answer matches its spec,
streamed or not, greedy or sampled, and P/D answers are byte-identical to colocated ones."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from kvferry.engine.llm import LLM
from kvferry.entrypoints.proxy.failover import SentTokens
from kvferry.sampling_params import SamplingParams
from kvferry.structured.params import StructuredOutputsParams
from tests import plain_http
from tests.proxy_fakes import free_port, start_cli
from tests.test_disagg import MODEL, Deployment, _disagg_args, _metric, _wait_blocks_free
from tests.test_structured import CHOICES, REGEX, SCHEMA
from tests.test_tools import TOOLS, WEATHER

pytestmark = pytest.mark.slow  # a disagg deployment (make test-all); tests/test_structured.py is the fast one

PROMPTS = ["The cat sees a small bird", "What is the capital of France?"]
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 100


@pytest.fixture(scope="module")
def deployment(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("structured_disagg")
    proc = start_cli(
        _disagg_args(tiny_llama, free_port(), tmp / "logs", "--enforce-eager"), tmp / "disagg.log"
    )
    try:
        yield Deployment(proc, tmp / "disagg.log")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, deployment: Deployment) -> dict[str, str]:
    """Greedy schema-constrained answers of the offline engine (while the deployment starts)."""
    llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    answers = {p: o.outputs[0].text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params))}
    answers["chat"] = llm.chat(MESSAGES, params)[0].outputs[0].text
    return answers


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _complete(url: str, prompt: str, stream: bool, **kwargs: object) -> str:
    args = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, **kwargs}
    client = _client(url)
    if not stream:
        return client.completions.create(**args).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))


def _chat(url: str, stream: bool, **kwargs: object) -> str:
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, **kwargs}
    client = _client(url)
    if not stream:
        return client.chat.completions.create(**args).choices[0].message.content or ""
    chunks = client.chat.completions.create(**args, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _valid(text: str) -> str:
    jsonschema.validate(json.loads(text), SCHEMA)
    return text


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_greedy_pd_equals_colocated(
    deployment: Deployment, reference: dict, stream: bool
) -> None:
    proxy, prefill, decode = deployment.ready()
    for url in (proxy, decode):
        for prompt in PROMPTS:
            extra = {"extra_body": {"guided_json": SCHEMA}}
            assert _valid(_complete(url, prompt, stream, temperature=0, **extra)) == reference[prompt]
        chat = _chat(url, stream, temperature=0, response_format=RESPONSE_FORMAT)
        assert _valid(chat) == reference["chat"]
    _wait_blocks_free(prefill)
    _wait_blocks_free(decode)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_sampled_answers_validate(deployment: Deployment, stream: bool) -> None:
    proxy, _, decode = deployment.ready()
    for seed in range(3):
        kwargs = {"temperature": 1.0, "seed": seed, "response_format": RESPONSE_FORMAT}
        pd = _valid(_chat(proxy, stream, **kwargs))
        assert pd == _valid(_chat(decode, stream, **kwargs))  # seeded: the same draws either way


def test_regex_and_choice_through_pd(deployment: Deployment) -> None:
    proxy, _, decode = deployment.ready()
    for url in (proxy, decode):
        regex = {"structured_outputs": {"regex": REGEX}}
        for stream in (False, True):
            assert re.fullmatch(REGEX, _complete(url, PROMPTS[0], stream, temperature=1.0, extra_body=regex))
            choice = {"guided_choice": CHOICES}
            assert _chat(url, stream, temperature=1.0, extra_body=choice) in CHOICES


def test_invalid_schema_is_a_400_naming_the_field(deployment: Deployment) -> None:
    proxy, _, decode = deployment.ready()
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuch"}}}
    for url in (proxy, decode):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "response_format": bad}
        response = plain_http.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "response_format"


def test_a_failover_continuation_resumes_the_grammar(deployment: Deployment) -> None:
    """What the proxy sends another decoder when one dies mid-answer (SentTokens.resume_body):
    the prompt's ids plus the tokens already sent; the grammar resumes after them, so the
    continuation completes the same JSON (without resumed_output_tokens it starts over)."""
    _, _, decode = deployment.ready()
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0}
    body |= {"guided_json": SCHEMA, "return_token_ids": True}
    whole = plain_http.post(decode + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    sent_ids = whole["token_ids"][:5]
    sent = SentTokens(chat=False)
    sent.record({"choices": [{"token_ids": sent_ids, "prompt_token_ids": whole["prompt_token_ids"]}]}, False)
    resumed = sent.resume_body(body)
    rest = plain_http.post(decode + "/v1/completions", json=resumed, timeout=60).json()["choices"][0]
    assert sent_ids + rest["token_ids"] == whole["token_ids"]
    _valid(whole["text"])
    resumed.pop("resumed_output_tokens")
    restarted = plain_http.post(decode + "/v1/completions", json=resumed, timeout=60).json()["choices"][0]
    assert sent_ids + restarted["token_ids"] != whole["token_ids"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_returns_a_parsed_call(deployment: Deployment, stream: bool) -> None:
    proxy, prefill, decode = deployment.ready()
    for url in (proxy, decode):
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "tools": TOOLS}
            kwargs |= {"tool_choice": choice, "parallel_tool_calls": False, "temperature": 1.0}
            calls, reason = _tool_calls(_client(url), kwargs, stream)
            assert reason == "tool_calls" and len(calls) == 1
            assert calls[0][0] in ("get_weather", "get_time")
            if calls[0][0] == "get_weather":
                jsonschema.validate(json.loads(calls[0][1]), WEATHER)
    _wait_blocks_free(prefill)


def _tool_calls(client: openai.OpenAI, kwargs: dict, stream: bool) -> tuple[list[tuple[str, str]], str]:
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
    else:  # the deltas as the openai client accumulates them
        state = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            state.handle_chunk(chunk)
        choice = state.current_completion_snapshot.choices[0]  # unparsed: a cut one too
    calls = choice.message.tool_calls or []
    return [(c.function.name, c.function.arguments) for c in calls], choice.finish_reason


def test_streamed_tool_calls_come_token_by_token_and_rebuild_the_answer(deployment: Deployment) -> None:
    """Greedy, streamed: the call's first delta has its id, type and name, the arguments come
    in fragments over several chunks, and the openai client's accumulation equals the
    non-streamed answer, through the proxy as from a decoder asked directly."""
    proxy, _, decode = deployment.ready()
    kwargs = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "tools": TOOLS,
        "temperature": 0,
    }
    kwargs["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    whole = _tool_calls(_client(decode), kwargs, stream=False)
    jsonschema.validate(json.loads(whole[0][0][1]), WEATHER)
    for url in (proxy, decode):
        required = {**kwargs, "tool_choice": "required", "parallel_tool_calls": False}
        assert _tool_calls(_client(url), required, stream=True) == _tool_calls(_client(url), required, False)
        assert _tool_calls(_client(url), kwargs, stream=True) == whole
        chunks = list(_client(url).chat.completions.create(**kwargs, stream=True))
        deltas = [
            c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
        ]
        assert deltas[0][0].id and deltas[0][0].function.name == "get_weather"
        assert len(deltas) > 2 and all(d[0].id is None and d[0].function.name is None for d in deltas[1:])


AUTO_CALL_REGEX = r'\{"name": "get_weather", "arguments": \{"city": "[a-z]{3,8}", "days": [1-7]\}\}'


def test_auto_tool_calls_stream_as_parsed(deployment: Deployment) -> None:
    """tool_choice auto (the tiny model's template: a call is a JSON object as the answer,
    Llama 3's form; a regex makes the random model write one): streamed, the call's name
    comes first and its arguments in fragments over several chunks, not whole in the last
    one; the client's accumulation equals the non-streamed answer, colocated and through
    the proxy, and a cut by max_tokens keeps the call so far either way."""
    proxy, prefill, decode = deployment.ready()
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto", "temperature": 0}
    kwargs |= {"max_tokens": MAX_TOKENS, "extra_body": {"structured_outputs": {"regex": AUTO_CALL_REGEX}}}
    whole = _tool_calls(_client(decode), kwargs, stream=False)
    assert whole[1] == "tool_calls" and whole[0][0][0] == "get_weather"
    jsonschema.validate(json.loads(whole[0][0][1]), WEATHER)
    usage = _client(decode).chat.completions.create(**kwargs).usage
    assert usage is not None
    cut = {**kwargs, "max_tokens": usage.completion_tokens - 3}  # inside the arguments
    cut_whole = _tool_calls(_client(decode), cut, stream=False)
    assert cut_whole[1] == "length" and cut_whole[0][0][0] == "get_weather"
    assert whole[0][0][1].startswith(cut_whole[0][0][1]) and cut_whole[0][0][1] != whole[0][0][1]
    for url in (proxy, decode):
        assert _tool_calls(_client(url), kwargs, stream=True) == whole
        assert _tool_calls(_client(url), cut, stream=True) == cut_whole
        chunks = list(_client(url).chat.completions.create(**kwargs, stream=True))
        deltas = [
            c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
        ]
        assert deltas[0][0].id and deltas[0][0].function.name == "get_weather"
        assert len(deltas) > 2 and all(d[0].function.name is None for d in deltas[1:])
    _wait_blocks_free(prefill)


EARLY = "kvferry_proxy:early_first_tokens_total"


def _accumulated(client: openai.OpenAI, kwargs: dict) -> tuple[str | None, list, str]:
    """A streamed chat answer as the openai client accumulates it: content, calls, finish."""
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        state.handle_chunk(chunk)
    choice = state.current_completion_snapshot.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}], ids=["greedy", "seeded"]
)
def test_tool_choice_none_and_named_stream_the_first_token_early(
    deployment: Deployment, sampling: dict
) -> None:
    """With tool_choice none the answer is plain content (the tools are neither shown nor
    parsed), with a named function it is the call: the proxy sends the prefiller's token
    early (as content; as the call's first tool_calls entry) and the stream, as the openai
    client accumulates it, equals a colocated one. With required the answer is the calls,
    parsed on the decoder: nothing goes early (kvferry/entrypoints/proxy/early_calls.py)."""
    proxy, prefill, decode = deployment.ready()
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "tools": TOOLS, **sampling}
    for choice in ("none", NAMED):
        request = {**kwargs, "tool_choice": choice}
        colocated = _accumulated(_client(decode), request)
        assert bool(colocated[0]) == (choice == "none") and bool(colocated[1]) == (choice == NAMED)
        early = _metric(proxy, EARLY)
        assert _accumulated(_client(proxy), request) == colocated
        assert _metric(proxy, EARLY) == early + 1, choice
    early = _metric(proxy, EARLY)
    required = {**kwargs, "tool_choice": "required", "parallel_tool_calls": False}
    assert _accumulated(_client(proxy), required)[2] in ("tool_calls", "length")
    assert _metric(proxy, EARLY) == early
    _wait_blocks_free(prefill)
    _wait_blocks_free(decode)
