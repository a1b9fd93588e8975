"""Tool calling in chat: ``tools``, ``tool_choice``, ``parallel_tool_calls``; tool calls
parsed from the answer and returned as OpenAI's ``tool_calls``.

The tools go to the chat template (each family's template writes them its own way). With
``tool_choice`` ``required`` or a named function, the answer is constrained by structured
output, as vLLM does: ``required`` to a JSON array of ``{"name", "parameters"}`` objects
(one item unless ``parallel_tool_calls``), a named function to its parameters' schema; the
answer is then the calls. With ``auto``, the answer is parsed in the format of the model's
chat template: Qwen 2.5/3 and Hermes ``<tool_call>{...}</tool_call>``, Mistral
``[TOOL_CALLS][{...}]``, Llama 3 and Gemma a bare JSON object (``{"name",
"parameters"|"arguments"}``, after ``<|python_tag|>`` or in a code fence). ``none``: the
tools are neither shown to the model nor parsed.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvferry.entrypoints.openai.auto_tool_stream import AutoToolStream, ToolCallFormat
from kvferry.entrypoints.openai.structured_protocol import StructuredOutputsFields
from kvferry.entrypoints.openai.tool_stream import ToolCallStream
from kvferry.errors import InvalidRequestError
from kvferry.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_STRICT = ConfigDict(extra="ignore", strict=True)


class FunctionDefinition(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = _STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: FunctionName


class ToolsFields(StructuredOutputsFields):
    """The chat request's tool fields; ``required`` and named choices become its grammar."""

    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def uses_tools(self) -> bool:
        """Whether the tools are shown to the model and its answer parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []] if self.uses_tools else None

    @property
    def forces_calls(self) -> bool:
        """``required`` or a named function: the answer is the calls (streamed as it grows)."""
        return self.uses_tools and self.tool_choice not in (None, "auto")

    def named_tool(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        own = super().structured_outputs_params()
        forced = self._forced_calls_spec()
        if forced is None:
            return own
        if own is not None:
            raise InvalidRequestError(
                "tool_choice required or a named function cannot be combined with another structured-output form",
                param="tool_choice",
            )
        forced.validate(param="tools")
        # a continued answer (P/D failover): the calls' grammar resumes after the answer so far
        return dataclasses.replace(forced, resumed_output_tokens=self.resumed_output_tokens)

    def _forced_calls_spec(self) -> StructuredOutputsParams | None:
        if self.tool_choice is None or self.tool_choice in ("none", "auto"):
            return None
        if not self.tools:
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        functions = {tool.function.name: tool.function for tool in self.tools}
        name = self.named_tool()
        if name is not None:
            if name not in functions:
                raise InvalidRequestError(
                    f"tool_choice names no tool of this request: {name!r}", param="tool_choice"
                )
            return StructuredOutputsParams(json=_parameters(functions[name]))
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": fn.name}, "parameters": _parameters(fn)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for fn in functions.values()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel_tool_calls:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)


def _parameters(fn: FunctionDefinition) -> dict[str, Any]:
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None
    tool_calls: list[ToolCall]


def parse_answer(text: str, request: ToolsFields, fmt: ToolCallFormat) -> ParsedAnswer:
    """The answer's content and tool calls, as the request's tool_choice and the model's
    format say: the same parse that streams them, run over the whole text, so a streamed
    answer and a non-streamed one agree (one cut off inside a call included: that call, its
    arguments as far as written)."""
    if request.forces_calls:  # the answer is the calls, as they were streamed
        scanned = ToolCallStream(request.named_tool())
        scanned.feed(text)
        return ParsedAnswer(None, [ToolCall(n, args) for n, args in scanned.calls])
    stream = AutoToolStream(fmt)
    content = stream.feed(text).content + stream.finish().content
    return ParsedAnswer(content or None, [ToolCall(n, args) for n, args in stream.calls])


def body_uses_tools(body: dict[str, Any]) -> bool:
    """For the P/D proxy: whether a chat body's answer is parsed for tool calls (its first
    token is then not streamed early as text)."""
    return bool(body.get("tools")) and body.get("tool_choice") != "none"
