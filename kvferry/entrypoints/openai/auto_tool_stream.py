"""Tool calls of an unconstrained answer (``tool_choice`` ``auto``), parsed as it grows.

The model writes its calls in its chat template's markup: Qwen 2.5/3 and Hermes
``<tool_call>{...}</tool_call>`` (text around the calls is content), Mistral
``[TOOL_CALLS][{...}, ...]`` (text before it is content), Llama 3 and Gemma a JSON call
object or list as the answer, after ``<|python_tag|>`` or in a code fence. A call is a JSON
object with a string ``name`` and its ``parameters`` or ``arguments``.

``AutoToolStream`` reads the answer a delta at a time and returns, per delta, the content to
send and the ``tool_calls`` entries (kvferry/entrypoints/openai/tool_stream.py writes them:
the first with the call's index, id, type and name, then argument fragments). Text that may
open a call is held back until it does or cannot; a call body that closes (or ends) without
a call name is given back as content, markup included. Whitespace between content and a
call is dropped. The non-streamed answer is this same parse over the whole text, so both
agree, and an answer cut off inside a call has that call, its arguments as far as written.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any

from kvferry.entrypoints.openai.tool_stream import ToolCallStream

logger = logging.getLogger(__name__)

_FENCE = "```"
_FENCE_LANGUAGES = ("", "json", "tool_code")


class ToolCallFormat(enum.Enum):
    HERMES = "hermes"  # Qwen 2.5/3, Hermes: <tool_call>{...}</tool_call>
    MISTRAL = "mistral"  # [TOOL_CALLS][{...}, ...]
    JSON = "json"  # Llama 3, Gemma: a JSON object (or list) as the whole answer

    @classmethod
    def of_template(cls, chat_template: str | None) -> ToolCallFormat:
        template = chat_template or ""
        if "<tool_call>" in template:
            return cls.HERMES
        if "[TOOL_CALLS]" in template:
            return cls.MISTRAL
        return cls.JSON

    @property
    def opener(self) -> str:
        """The markup before a call body (Llama 3 and Gemma: none, the answer starts with it)."""
        return {ToolCallFormat.HERMES: "<tool_call>", ToolCallFormat.MISTRAL: "[TOOL_CALLS]"}.get(self, "")


@dataclass
class StreamDelta:
    """What one piece of the answer adds: content text and tool_calls entries."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class _Phase(enum.Enum):
    TEXT = "text"  # content, watching for the opener
    START = "start"  # Llama 3 / Gemma: the answer's start, which may be a call
    BODY = "body"  # a call body's JSON
    CLOSING = "closing"  # after a body: its closing markup, skipped


class AutoToolStream:
    """Parses one answer's content and tool calls in ``fmt`` as the answer grows."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self._fmt = fmt
        self._phase = _Phase.START if fmt is ToolCallFormat.JSON else _Phase.TEXT
        self._buffer = ""  # text received, not yet classified
        self._held_space = ""  # whitespace after content: sent only if content follows
        self._body: ToolCallStream | None = None
        self._body_text = ""  # the body's markup and text so far, given back if no call
        self._closer = ""
        self._finished: list[tuple[str, str]] = []  # calls of closed bodies
        self._out = StreamDelta()

    @property
    def calls(self) -> list[tuple[str, str]]:
        """(name, arguments) of every call read so far."""
        return self._finished + (self._body.calls if self._body is not None else [])

    def feed(self, text: str) -> StreamDelta:
        """The content and tool_calls entries that ``text``, the answer's next piece, adds."""
        self._buffer += text
        while self._buffer and self._step():
            pass
        out, self._out = self._out, StreamDelta()
        return out

    def finish(self) -> StreamDelta:
        """The answer ended: what was held back (a body with no call, a partial opener)."""
        if self._phase is _Phase.BODY and self._body is not None and self._body.calls:
            self._finished += self._body.calls  # cut off inside a call: the call so far
        elif self._phase is _Phase.BODY:
            self._content(self._body_text)
        elif self._phase in (_Phase.TEXT, _Phase.START):
            self._content(self._buffer)
        self._buffer, self._body = "", None
        if not self.calls and self._held_space:
            self._out.content += self._held_space
        self._held_space = ""
        out, self._out = self._out, StreamDelta()
        return out

    def _step(self) -> bool:
        """Consume what the buffer allows in the current phase; False: wait for more text."""
        if self._phase is _Phase.TEXT:
            return self._step_text()
        if self._phase is _Phase.START:
            return self._step_start()
        if self._phase is _Phase.BODY:
            return self._step_body()
        return self._step_closing()

    def _step_text(self) -> bool:
        opener = self._fmt.opener
        at = self._buffer.find(opener) if opener else -1
        if at >= 0:
            self._content(self._buffer[:at])
            closer = "</tool_call>" if self._fmt is ToolCallFormat.HERMES else ""
            self._open_body(opener, self._buffer[at + len(opener) :], closer)
            return True
        keep = _partial_suffix(self._buffer, opener) if opener else 0
        self._content(self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _step_start(self) -> bool:
        """Llama 3 / Gemma: a call only as the answer's start (after ``<|python_tag|>`` or a
        fence line); anything else makes the whole answer content."""
        head = self._buffer.lstrip()
        if not head:
            return False
        for prefix in ("<|python_tag|>", _FENCE):
            if prefix.startswith(head) and head != prefix:
                return False  # could still become the prefix
        if head.startswith("<|python_tag|>"):
            rest = head.removeprefix("<|python_tag|>").lstrip()
            marker = self._buffer[: len(self._buffer) - len(rest)]
            if not rest:
                return False
            if rest[0] in "[{":
                self._open_body(marker, rest, closer="")
                return True
        elif head.startswith(_FENCE):
            line_end = head.find("\n")
            if line_end < 0:
                return False
            if head[len(_FENCE) : line_end].strip() in _FENCE_LANGUAGES:
                marker = self._buffer[: len(self._buffer) - len(head) + line_end + 1]
                self._open_body(marker, head[line_end + 1 :], closer=_FENCE)
                return True
        elif head[0] in "[{":
            self._open_body("", self._buffer, closer="")
            return True
        self._phase = _Phase.TEXT  # JSON has no opener: the rest is content
        return True

    def _open_body(self, markup: str, rest: str, closer: str) -> None:
        self._phase, self._buffer, self._closer = _Phase.BODY, rest, closer
        # the whitespace before a call is not content, unless the call turns out not to be one
        self._body_text, self._held_space = self._held_space + markup, ""
        self._body = ToolCallStream(None, first_index=len(self._finished))

    def _step_body(self) -> bool:
        body = self._body
        assert body is not None
        for index, char in enumerate(self._buffer):
            if not body.opened and not char.isspace() and char not in "[{":
                self._abandon_body()  # markup not followed by JSON: content after all
                return True
            self._body_text += char
            self._out.tool_calls += body.feed(char)
            if body.closed:
                self._buffer = self._buffer[index + 1 :]
                self._close_body(body)
                return True
        self._buffer = ""
        return False

    def _abandon_body(self) -> None:
        self._content(self._body_text)
        self._body, self._body_text = None, ""
        self._phase = _Phase.TEXT

    def _close_body(self, body: ToolCallStream) -> None:
        if not body.calls:
            self._abandon_body()
            return
        self._finished += body.calls
        self._body, self._body_text = None, ""
        self._phase = _Phase.CLOSING

    def _step_closing(self) -> bool:
        """Skip the whitespace after a body, its closing markup and the whitespace after it."""
        head = self._buffer = self._buffer.lstrip()
        if not head:
            return False
        if self._closer and head.startswith(self._closer):
            self._buffer, self._closer = head[len(self._closer) :], ""
            return True
        if self._closer.startswith(head):
            return False  # the closing markup may still come
        self._phase = _Phase.TEXT
        return True

    def _content(self, text: str) -> None:
        """Content text, its trailing whitespace held until more content follows it."""
        if not text:
            return
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body) :]
        self._out.content += body


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (held back)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
