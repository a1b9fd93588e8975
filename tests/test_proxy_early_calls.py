"""Which chat requests with tools get the proxy's early first token, and a named call's
early entry and its stripping from the decoder's stream (units; tests/test_structured_pd.py
streams them through real engines)."""

from __future__ import annotations

from kvferry.entrypoints.openai.tool_stream import ToolCallStream
from kvferry.entrypoints.proxy.early_calls import (
    call_arguments,
    early_with_tools,
    first_call,
    named_function,
    strip_calls,
)
from kvferry.entrypoints.proxy.streaming import early_chunks, strip_sent

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CHAT = "/v1/chat/completions"


def test_tool_choices_that_allow_the_early_token() -> None:
    assert early_with_tools({}) and early_with_tools({"tools": TOOLS, "tool_choice": "none"})
    assert early_with_tools({"tools": TOOLS, "tool_choice": NAMED})
    assert not early_with_tools({"tools": TOOLS}) and not early_with_tools(
        {"tools": TOOLS, "tool_choice": "auto"}
    )
    assert not early_with_tools({"tools": TOOLS, "tool_choice": "required"})
    assert named_function({"tools": TOOLS, "tool_choice": NAMED}) == "get_weather"
    assert named_function({"tool_choice": NAMED}) is None  # no tools: the server refuses it anyway
    assert named_function({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}) is None


def _prefill(arguments: str) -> dict:
    call = {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]}}]
    }


def test_first_call_is_the_announcement_a_server_streams_first() -> None:
    entry = first_call(_prefill('{"'), "get_weather")
    want = ToolCallStream("get_weather").feed('{"')[0]
    assert entry is not None and {**entry, "id": want["id"]} == want
    assert entry["function"] == {"name": "get_weather", "arguments": '{"'} and call_arguments(entry) == '{"'
    assert call_arguments(first_call(_prefill(""), "get_weather")) == ""  # no text: not sent early
    assert first_call({"choices": [{"message": {"content": "hi"}}]}, "get_weather") is None
    assert call_arguments(None) == ""


def test_the_decoder_announcement_and_sent_arguments_are_stripped() -> None:
    announce = {
        "index": 0,
        "id": "call_d",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"ci'},
    }
    kept, pending = strip_calls([announce], '{"')
    assert kept == [{"index": 0, "function": {"arguments": "ci"}}] and pending == ""
    kept, pending = strip_calls([{**announce, "function": {"name": "get_weather", "arguments": '{"'}}], '{"')
    assert kept == [] and pending == ""
    more = {"index": 0, "function": {"arguments": "ty"}}
    assert strip_calls([more], "") == ([more], "")


def test_named_call_chunks_for_n_answers() -> None:
    entry = first_call(_prefill('{"'), "get_weather")
    chunks = early_chunks(CHAT, {"created": 1, "model": "m"}, '{"', answers=2, call=entry)
    assert [c["choices"][0]["delta"] for c in chunks[2:]] == [{"tool_calls": [entry]}]
    other = {
        "index": 1,
        "id": "call_o",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"'},
    }
    chunk = {"choices": [{"index": 1, "delta": {"tool_calls": [other]}, "finish_reason": None}]}
    out, pending = strip_sent(CHAT, chunk, '{"')
    assert out is not None and out["choices"][0]["delta"] == {"tool_calls": [other]}  # choice 1's own call
    assert pending == '{"'
