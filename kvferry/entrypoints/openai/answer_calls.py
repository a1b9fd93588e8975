"""The tool calls of one streamed chat answer: the parser that reads it, the delta each
piece of its text gives, and where a resumed answer's parse starts.

``required`` and named calls are the whole answer (tool_stream.py); with ``auto`` they are
found in the chat template's markup around the answer's text (auto_tool_stream.py).

A resumed answer: the P/D proxy continues a streamed answer whose decoder was lost on
another one (kvferry/entrypoints/proxy/failover.py), as a request whose prompt ends with
the answer's tokens sent so far, ``resumed_output_tokens`` of them. The client already has
what a parser made of their text. So the new parser is primed with that text, decoded as
an output processor streamed it (``resumed_answer``), and what it parses from it is
dropped: the stream goes on from the parser's state there, and the continuation's deltas
are exactly those the undisturbed answer had from that point (the same call index, no
second announcement of a call, argument fragments that extend the client's arguments,
content only where content is, text held back for a possible opener still held back). One
mechanism for every parser and format: feed the resumed text, send nothing of it.

Call ids: a call whose name the resumed text completes was announced to the client with
the lost decoder's id (a named call's early first token: the proxy's). The primed parser
counts it announced and sends only its ``index`` and argument fragments, which the
client's accumulation adds to the call it has under that index, so the client keeps the
id it got. Neither the server nor the proxy keeps or rewrites ids: the proxy would need
to parse every decoder's calls to map them, and a server that sent the announcement again
would have the client concatenate a second id and name onto the first. A call first
named in the continuation gets this server's id, sent once, as any call's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvferry.engine.detokenizer import streamed_text
from kvferry.entrypoints.openai.auto_tool_stream import AutoToolStream, StreamDelta, ToolCallFormat
from kvferry.entrypoints.openai.tool_stream import ToolCallStream
from kvferry.entrypoints.openai.tools import ToolsFields

if TYPE_CHECKING:
    from collections.abc import Sequence

    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CallsStream = ToolCallStream | AutoToolStream


def calls_stream(body: ToolsFields, fmt: ToolCallFormat, resumed: str | None = None) -> CallsStream:
    """The parser of one streamed answer with tools, primed with ``resumed``: the answer's
    text the client already has, whose parse is not sent again (None: a new answer; ""
    is an answer resumed after tokens with no text, which a named call's parser has
    announced the call for, as for any first output)."""
    stream: CallsStream = ToolCallStream(body.named_tool()) if body.forces_calls else AutoToolStream(fmt)
    if resumed is not None:
        stream.feed(resumed)  # what it returns was sent by the server that wrote this text
    return stream


def resumed_answer(
    tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int], count: int, skip_special_tokens: bool
) -> str | None:
    """The text of a resumed answer: the prompt's last ``count`` tokens, as an output
    processor streamed them after the prompt before them (None when nothing is resumed)."""
    count = min(count, len(prompt_token_ids))
    if count <= 0:
        return None
    ids = list(prompt_token_ids)
    return streamed_text(tokenizer, ids[:-count], ids[-count:], skip_special_tokens)


def calls_delta(stream: CallsStream, text: str, finished: bool) -> dict[str, Any]:
    """The chunk's delta for the answer's next ``text``: its content and tool_calls entries."""
    if isinstance(stream, ToolCallStream):
        entries = stream.feed(text)
        return {"tool_calls": entries} if entries else {}
    part = stream.feed(text)
    if finished:
        tail = stream.finish()
        part = StreamDelta(part.content + tail.content, part.tool_calls + tail.tool_calls)
    delta: dict[str, Any] = {"content": part.content} if part.content else {}
    if part.tool_calls:
        delta["tool_calls"] = part.tool_calls
    return delta
