"""Tool calls of a constrained answer, streamed as OpenAI's deltas while the answer grows.

With ``tool_choice`` ``required`` the answer is a JSON array of ``{"name", "parameters"}``
objects; with a named function it is that function's arguments object (both generated
under their schema, kvferry/entrypoints/openai/tools.py). ``ToolCallStream`` scans the text
a character at a time (strings and escapes understood, nesting counted) and returns, per
delta of text, the ``tool_calls`` entries to send: a call's first entry carries its
``index``, ``id``, ``type`` and function ``name`` (with the arguments so far), the next ones
fragments of its ``arguments``. A call's arguments are the raw text of its parameters
value, exactly as written, so the non-streamed answer (the same scan over the whole text)
and a client's accumulation of the deltas give the same call.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_ARGUMENT_KEYS = ("parameters", "arguments")


@dataclass
class _Call:
    """One call being scanned: its name once read, its arguments' text so far."""

    name: str | None = None
    arguments: str = ""
    sent_arguments: int = 0  # characters of `arguments` already in a delta
    announced: bool = False
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


class ToolCallStream:
    """Streams the calls of one answer (``named``: the function a named tool_choice forces,
    whose arguments are the whole answer; None: ``required``'s array of calls)."""

    def __init__(self, named: str | None, first_index: int = 0) -> None:
        self._named = named
        self._first_index = first_index  # the index of this stream's first call in the answer
        self._calls: list[_Call] = [_Call(name=named)] if named is not None else []
        self._depth = 0  # brackets open outside strings (the array: 1, a call object: 2)
        self._call_depth = 2  # where call objects open: 2 in an array, 1 for a bare object
        self._opened = False
        self._in_string = False
        self._escape = False
        self._token = ""  # the string being read at a call object's level, quotes included
        self._last_key: str | None = None
        self._value: str | None = None  # whose value is being read: "name", "parameters", ...
        self._arguments_depth = 0  # brackets open inside the arguments value

    @property
    def opened(self) -> bool:
        """Whether the outermost bracket has been read."""
        return self._opened

    @property
    def closed(self) -> bool:
        """Whether the outermost bracket (the array, or a bare call object) has closed."""
        return self._opened and self._depth == 0

    @property
    def calls(self) -> list[tuple[str, str]]:
        """(name, arguments) of each call whose name is known."""
        return [(c.name, c.arguments) for c in self._calls if c.name is not None]

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The tool_calls delta entries that ``text`` (the answer's next piece) completes."""
        for char in text:
            if self._named is not None:
                if not char.isspace() or self._calls[0].arguments:
                    self._calls[0].arguments += char
            elif self._value in _ARGUMENT_KEYS:
                self._argument_char(char)
            else:
                self._scan(char)
        return self._pending()

    def _scan(self, char: str) -> None:
        """One character of a ``required`` answer outside arguments:
        ``[{"name": ..., "parameters": ...}, ...]``."""
        if self._in_string:
            self._string_char(char)
        elif char == '"':
            self._in_string, self._token = True, '"'
        elif char in "[{":
            if not self._opened:
                self._opened, self._call_depth = True, 2 if char == "[" else 1
            self._depth += 1
            if self._depth == self._call_depth and char == "{":
                self._calls.append(_Call())
        elif char in "]}":
            self._depth -= 1
        elif char == ":" and self._depth == self._call_depth:
            self._value, self._arguments_depth = self._last_key, 0
        elif char == "," and self._depth == self._call_depth:
            self._value = None

    def _string_char(self, char: str) -> None:
        self._token += char
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            text = json.loads(self._token)
            if self._value == "name" and self._calls:
                self._calls[-1].name, self._value = text, None
            else:
                self._last_key = text

    def _argument_char(self, char: str) -> None:
        """One character of a call's arguments value, kept as written."""
        call = self._calls[-1]
        if not call.arguments and char.isspace():
            return
        scalar_ended = call.arguments and self._arguments_depth == 0 and not self._in_string
        if scalar_ended and char in ",}":
            self._value = None
            self._scan(char)
            return
        call.arguments += char
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "[{":
            self._arguments_depth += 1
        elif char in "]}":
            self._arguments_depth -= 1
            if self._arguments_depth == 0:
                self._value = None  # the arguments object closed

    def _pending(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = []
        for index, call in enumerate(self._calls, start=self._first_index):
            if call.name is None:
                continue
            fragment = call.arguments[call.sent_arguments :]
            if not call.announced:
                call.announced = True
                function = {"name": call.name, "arguments": fragment}
                entries.append({"index": index, "id": call.id, "type": "function", "function": function})
            elif fragment:
                entries.append({"index": index, "function": {"arguments": fragment}})
            call.sent_arguments = len(call.arguments)
        return entries
