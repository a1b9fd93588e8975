"""Tool calling: tool_choice to a grammar, and tool calls parsed from each family's format."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from kvferry.entrypoints.openai.answer_calls import CallsStream, calls_delta, calls_stream
from kvferry.entrypoints.openai.auto_tool_stream import AutoToolStream, ToolCallFormat
from kvferry.entrypoints.openai.protocol import ChatCompletionRequest
from kvferry.entrypoints.openai.tool_stream import ToolCallStream
from kvferry.entrypoints.openai.tools import parse_answer
from kvferry.errors import InvalidRequestError

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]


def _request(**fields: object) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, **fields}
    return ChatCompletionRequest.model_validate(body)


def test_required_and_named_choices_become_schemas() -> None:
    required = (
        _request(tool_choice="required", parallel_tool_calls=False).to_sampling_params().structured_outputs
    )
    assert required is not None and required.json is not None
    schema = json.loads(required.json)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # one call only, and a known name
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)
    named = {"type": "function", "function": {"name": "get_weather"}}
    spec = _request(tool_choice=named).to_sampling_params().structured_outputs
    assert spec is not None and json.loads(spec.json or "") == WEATHER
    for choice in ("auto", "none", None):
        assert _request(tool_choice=choice).to_sampling_params().structured_outputs is None
    assert _request(tool_choice="none").template_tools() is None
    assert _request().template_tools() == TOOLS


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_resumed_answers_call_grammar_resumes_after_it(choice: object) -> None:
    """The P/D proxy's failover continues an answer from its tokens so far (the prompt's
    last resumed_output_tokens): the forced calls' grammar resumes after them."""
    spec = _request(tool_choice=choice, resumed_output_tokens=3).to_sampling_params().structured_outputs
    assert spec is not None and spec.resumed_output_tokens == 3


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required", "tools": None},
        {"tool_choice": "required", "guided_regex": "a"},
    ],
)
def test_bad_tool_choices_are_400s(fields: dict) -> None:
    with pytest.raises(InvalidRequestError) as err:
        _request(**fields).to_sampling_params()
    assert err.value.param == "tool_choice"


CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
ARGS = json.dumps(CALL["arguments"])


@pytest.mark.parametrize(
    ("fmt", "text", "content"),
    [
        (
            ToolCallFormat.HERMES,
            f"Let me look.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>",
            "Let me look.",
        ),
        (ToolCallFormat.MISTRAL, f"[TOOL_CALLS][{json.dumps(CALL)}]", None),
        (ToolCallFormat.JSON, '<|python_tag|>{"name": "get_weather", "parameters": ' + ARGS + "}", None),
        (ToolCallFormat.JSON, f"```tool_code\n{json.dumps(CALL)}\n```", None),  # Gemma's fence
    ],
)
def test_auto_parses_each_family(fmt: ToolCallFormat, text: str, content: str | None) -> None:
    parsed = parse_answer(text, _request(tool_choice="auto"), fmt)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", CALL["arguments"])
    ]


def test_text_that_is_no_call_stays_content() -> None:
    for fmt in ToolCallFormat:
        for text in ("Paris is sunny.", '{"city": "Paris"}', "<tool_call>{broken"):
            parsed = parse_answer(text, _request(), fmt)
            assert (parsed.content, parsed.tool_calls) == (text, [])


def test_forced_answers_are_the_calls() -> None:
    required = parse_answer(
        json.dumps([{"name": "get_time", "parameters": {}}]),
        _request(tool_choice="required"),
        ToolCallFormat.JSON,
    )
    assert [(c.name, c.arguments) for c in required.tool_calls] == [("get_time", "{}")]
    named = _request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert parse_answer(ARGS, named, ToolCallFormat.HERMES).tool_calls[0].name == "get_weather"


def test_template_formats() -> None:
    assert ToolCallFormat.of_template("{% if tools %}<tool_call>{% endif %}") is ToolCallFormat.HERMES
    assert ToolCallFormat.of_template("[AVAILABLE_TOOLS] [TOOL_CALLS]") is ToolCallFormat.MISTRAL
    assert ToolCallFormat.of_template("<|python_tag|>") is ToolCallFormat.JSON
    assert ToolCallFormat.of_template(None) is ToolCallFormat.JSON


STREAMED_ANSWERS = [
    (
        "required",
        '[{"name":"get_weather","parameters":{"city":"P\\"}a","days":2}},{"name":"get_time","parameters":{}}]',
    ),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city":"Paris","days":3}'),
]


@pytest.mark.parametrize(("choice", "text"), STREAMED_ANSWERS)
def test_streamed_calls_rebuild_the_non_streamed_ones(choice: object, text: str) -> None:
    """Fed a token's worth of text at a time, the stream's deltas (the first with the call's
    id, type and name, then argument fragments), accumulated by the openai client, give
    the calls of the non-streamed answer: same names, same arguments text."""
    request = _request(tool_choice=choice)
    stream = ToolCallStream(request.named_tool())
    state = ChatCompletionStreamState()
    deltas = [stream.feed(text[i : i + 3]) for i in range(0, len(text), 3)]
    assert sum(len(d) for d in deltas) > len(parse_answer(text, request, ToolCallFormat.JSON).tool_calls)
    for delta in [*deltas, []]:
        state.handle_chunk(
            _chunk({"tool_calls": delta} if delta else {}, "tool_calls" if not delta else None)
        )
    streamed = state.get_final_completion().choices[0].message.tool_calls or []
    expected = parse_answer(text, request, ToolCallFormat.JSON).tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.name, c.arguments) for c in expected
    ]
    assert json.loads(expected[0].arguments)["city"] in ('P"}a', "Paris")


def _chunk(delta: dict, finish_reason: str | None) -> ChatCompletionChunk:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    return ChatCompletionChunk.model_validate(
        {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [choice]}
    )


def _streamed(text: str, request: ChatCompletionRequest, fmt: ToolCallFormat, size: int) -> list[dict]:
    """The deltas of ``text`` streamed ``size`` characters at a time, as the server sends them."""
    if request.forces_calls:
        calls = ToolCallStream(request.named_tool())
        return [
            {"tool_calls": e}
            for i in range(0, max(len(text), 1), size)
            if (e := calls.feed(text[i : i + size]))
        ]
    auto = AutoToolStream(fmt)
    parts = [auto.feed(text[i : i + size]) for i in range(0, len(text), size)] + [auto.finish()]
    deltas = []
    for part in parts:
        delta: dict = {"content": part.content} if part.content else {}
        deltas.append(delta | ({"tool_calls": part.tool_calls} if part.tool_calls else {}))
    return [d for d in deltas if d]


def _accumulated(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """What the openai client rebuilds from the deltas: content and (name, arguments)."""
    state = ChatCompletionStreamState()
    for delta in [*deltas, {}]:
        state.handle_chunk(_chunk(delta, "stop" if not delta else None))  # the reason plays no part
    message = state.get_final_completion().choices[0].message
    return message.content, [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _merged(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """The same accumulation as the client's, done directly (cheap, for every cut)."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            name, args = calls.get(entry["index"], ("", ""))
            function = entry["function"]
            calls[entry["index"]] = (name + function.get("name", ""), args + function["arguments"])
    return content or None, [calls[i] for i in sorted(calls)]


HERMES_TWO_CALLS = (
    f"Let me look.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>\n"
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
AUTO_ANSWERS = [
    (ToolCallFormat.HERMES, HERMES_TWO_CALLS),
    (ToolCallFormat.HERMES, "No call: <tool_cal> <tool_call>{broken"),
    (ToolCallFormat.MISTRAL, f"Sure. [TOOL_CALLS][{json.dumps(CALL)}]"),
    (ToolCallFormat.JSON, '<|python_tag|>{"name": "get_weather", "parameters": ' + ARGS + "}"),
    (ToolCallFormat.JSON, f"```tool_code\n{json.dumps(CALL)}\n```"),
    (ToolCallFormat.JSON, '{"city": "Paris"} is JSON, not a call'),
]


@pytest.mark.parametrize(("fmt", "text"), AUTO_ANSWERS)
def test_auto_calls_stream_as_parsed_and_agree_with_the_whole_answer(fmt: ToolCallFormat, text: str) -> None:
    """tool_choice auto: the content before a call comes as content deltas, each call as it
    is written (its name first, then argument fragments), and the client's accumulation is
    the non-streamed answer; at every cut of the answer (max_tokens) too."""
    request = _request(tool_choice="auto")
    whole = parse_answer(text, request, fmt)
    for size in (1, 3, 7):
        deltas = _streamed(text, request, fmt, size)
        expected = (whole.content, [(c.name, c.arguments) for c in whole.tool_calls])
        assert _accumulated(deltas) == expected == _merged(deltas)
        with_calls = [i for i, d in enumerate(deltas) if "tool_calls" in d]
        if whole.tool_calls and size == 1:
            assert len(with_calls) > 2 * len(whole.tool_calls)  # not whole, in one last delta
            assert all("tool_calls" not in d for d in deltas[: with_calls[0]])  # text first
    for cut in range(len(text)):
        prefix = text[:cut]
        part = parse_answer(prefix, request, fmt)
        streamed = _merged(_streamed(prefix, request, fmt, 2))
        assert streamed == (part.content, [(c.name, c.arguments) for c in part.tool_calls])


@pytest.mark.parametrize(("choice", "text"), STREAMED_ANSWERS)
def test_a_forced_call_cut_off_is_the_same_streamed_or_not(choice: object, text: str) -> None:
    """A required or named call cut off by max_tokens: the non-streamed answer has the calls
    as far as written (names known, arguments so far), exactly what the stream sent."""
    request = _request(tool_choice=choice)
    for cut in range(len(text)):
        prefix = text[:cut]
        whole = [(c.name, c.arguments) for c in parse_answer(prefix, request, ToolCallFormat.JSON).tool_calls]
        assert _merged(_streamed(prefix, request, ToolCallFormat.JSON, 2)) == (None, whole)
        if '"parameters"' in prefix:
            assert whole and whole[0][0] == "get_weather"


def test_auto_parses_cut_off_calls_and_keeps_text() -> None:
    cut = HERMES_TWO_CALLS[: HERMES_TWO_CALLS.index('"days"')]
    parsed = parse_answer(cut, _request(tool_choice="auto"), ToolCallFormat.HERMES)
    assert parsed.content == "Let me look."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Paris", ')]
    text = AUTO_ANSWERS[1][1]
    assert parse_answer(text, _request(tool_choice="auto"), ToolCallFormat.HERMES).content == text


# Every forced answer and every auto answer in each markup (Hermes, Mistral, JSON).
RESUMED_ANSWERS = [(choice, ToolCallFormat.JSON, text) for choice, text in STREAMED_ANSWERS] + [
    ("auto", fmt, text) for fmt, text in AUTO_ANSWERS
]


@pytest.mark.parametrize(("choice", "fmt", "text"), RESUMED_ANSWERS)
def test_a_resumed_answer_streams_on_as_the_undisturbed_one(
    choice: object, fmt: ToolCallFormat, text: str
) -> None:
    """A P/D decoder lost mid-answer; another continues it (resumed_output_tokens), its
    parser primed with the text the client has. At every cut, what the lost decoder sent
    joined with the continuation's deltas is exactly the undisturbed stream (same call
    indices, argument fragments, content), each call announced once (one id, one name)."""
    request = _request(tool_choice=choice, resumed_output_tokens=1)
    for cut in range(len(text) + 1):
        before, after = _pieces(text[:cut]), _pieces(text[cut:])
        whole = _server_deltas(calls_stream(request, fmt), [*before, *after])
        lost = _server_deltas(calls_stream(request, fmt), before, finished=False)
        primed = calls_stream(request, fmt, text[:cut] if cut else None)  # cut 0: nothing to resume
        resumed = _server_deltas(primed, after)
        joined, ids = _without_ids(lost + resumed)
        assert joined == _without_ids(whole)[0]
        assert len(ids) == len(set(ids)) == len(parse_answer(text, request, fmt).tool_calls)
    cut = len(text) // 2
    lost = _server_deltas(calls_stream(request, fmt), _pieces(text[:cut]), finished=False)
    resumed = _server_deltas(calls_stream(request, fmt, text[:cut]), _pieces(text[cut:]))
    whole = parse_answer(text, request, fmt)
    assert _accumulated(lost + resumed) == (whole.content, [(c.name, c.arguments) for c in whole.tool_calls])


def _pieces(text: str, size: int = 2) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _server_deltas(stream: CallsStream, pieces: list[str], finished: bool = True) -> list[dict]:
    """The non-empty deltas a server sends for ``pieces`` of an answer (then its end)."""
    deltas = [calls_delta(stream, piece, False) for piece in pieces]
    if finished:
        deltas.append(calls_delta(stream, "", True))
    return [d for d in deltas if d]


def _without_ids(deltas: list[dict]) -> tuple[list[dict], list[str]]:
    """The deltas without their calls' ids, and those ids (ids are random per stream)."""
    ids: list[str] = []
    plain = []
    for delta in deltas:
        entries = []
        for entry in delta.get("tool_calls", []):
            if "id" in entry:
                ids.append(entry["id"])
            entries.append({k: v for k, v in entry.items() if k != "id"})
        plain.append({**delta, "tool_calls": entries} if entries else delta)
    return plain, ids
