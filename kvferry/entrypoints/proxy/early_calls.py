"""Which chat requests with tools get the early first token, and how a named call's goes.

``tool_choice`` ``none``: the tools are neither shown to the model nor parsed, so the answer
is plain content and its first token goes early as for any answer.

A named function: the answer is that function's arguments (a JSON object under its
schema), which a colocated server streams as ``tool_calls`` deltas
(openai/tool_stream.py): the first entry announces the call (``index``, ``id``, ``type``,
function ``name``) with the arguments so far, the next ones carry fragments of the
arguments. The prefiller's one-token answer is parsed the same way (its message has the
one call, whose arguments are that token's text), so the proxy sends the announcement with
those arguments as soon as the prefill answers, and drops from choice 0 of the decoder's
stream the announcement's ``id``, ``type`` and ``name`` and the arguments already sent. The
openai client's accumulation of the stream then equals a colocated one's (the call's id is
the proxy's, as random as the server's). After a decoder failover the continuation's
parser starts where the answer stands (openai/answer_calls.py): it announces the call
only when nothing of the answer was sent yet (the answer starts over; the announcement is
dropped as above), otherwise it sends argument fragments alone, which the stripping
leaves as they are.

Not for ``auto`` or ``required``:

- ``required``: the answer is a JSON array of ``{"name", "parameters"}`` objects and a
  call's first delta needs its name, which the first token never completes (it is ``[`` or
  ``[{"``): there is nothing to send early, and nothing to take it from (the prefill's
  parsed message has no call yet).
- ``auto``: whether the first token is content or opens a call depends on the model's
  tool-call markup, which a colocated server reads from its chat template and holds text
  back for until it knows (openai/auto_tool_stream.py). The proxy does not have the
  template, so text it sent early could be what a colocated server sends as a call, or
  holds back.
"""

from __future__ import annotations

import logging
from typing import Any

from kvferry.entrypoints.openai.tool_stream import ToolCallStream
from kvferry.entrypoints.openai.tools import body_uses_tools

logger = logging.getLogger(__name__)


def named_function(body: dict[str, Any]) -> str | None:
    """The function a chat body's ``tool_choice`` names (None: it names none)."""
    choice = body.get("tool_choice")
    function = choice.get("function") if isinstance(choice, dict) and body.get("tools") else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) and name else None


def early_with_tools(body: dict[str, Any]) -> bool:
    """Whether a body's tools allow the early first token: none are used (no tools, or
    ``tool_choice`` none), or a named function is forced."""
    return not body_uses_tools(body) or named_function(body) is not None


def first_call(prefill_response: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The ``tool_calls`` entry a colocated server streams first for the prefill's token:
    the call's announcement with its arguments so far (None: the answer has no call)."""
    choice = (prefill_response.get("choices") or [{}])[0]
    calls = (choice.get("message") or {}).get("tool_calls") or [{}]
    function = calls[0].get("function") if isinstance(calls[0], dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return None
    entries = ToolCallStream(name).feed(arguments)
    return entries[0] if entries else None


def call_arguments(entry: dict[str, Any] | None) -> str:
    """The arguments text an announcement entry carries ("" for None)."""
    function = entry.get("function") if entry is not None else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    return arguments if isinstance(arguments, str) else ""


def skip_sent(text: str, pending: str) -> tuple[str, str]:
    """``text`` without the start that is still ``pending`` (sent early); what stays pending."""
    n = min(len(text), len(pending))
    if text[:n] != pending[:n]:
        logger.warning("decoder's text %r does not start with the prefill's first token %r", text, pending)
        return text[n:], ""
    return text[n:], pending[n:]


def strip_calls(entries: list[dict[str, Any]], pending: str) -> tuple[list[dict[str, Any]], str]:
    """Choice 0's ``tool_calls`` entries without what the early announcement sent: its id,
    type and name, and the ``pending`` arguments; entries left with nothing are dropped."""
    kept = []
    for entry in entries:
        entry = {k: v for k, v in entry.items() if k not in ("id", "type")}
        function = {k: v for k, v in (entry.get("function") or {}).items() if k != "name"}
        arguments = function.pop("arguments", None) or ""
        arguments, pending = skip_sent(arguments, pending) if arguments and pending else (arguments, pending)
        if arguments:
            function["arguments"] = arguments
        if function:
            kept.append({**entry, "function": function})
    return kept, pending
