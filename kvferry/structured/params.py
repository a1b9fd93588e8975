"""What a request's output must match: a JSON schema, any JSON object, a regex, a choice
of strings, or a grammar (Lark, or GBNF/EBNF as llama.cpp writes them).

The spec is a frozen dataclass, hashable (a schema is kept as canonical JSON text), so it
keys the compiled-grammar cache and crosses to the engine core with the sampling
parameters. ``validate`` compiles the grammar without a tokenizer and names the request
field that is wrong (a bad schema, regex or grammar is the client's error: HTTP 400).
"""

from __future__ import annotations

import enum
import functools
import json
import logging
from dataclasses import dataclass, field, fields
from typing import Any

from kvferry.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class StructureKind(enum.Enum):
    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the grammar fields is set. ``json``: a JSON schema (a dict or its JSON
    text); ``json_object``: any JSON object; ``choice``: one of the strings, verbatim.
    ``resumed_output_tokens``: the prompt's last N tokens are the answer so far (a P/D
    failover continues an answer on another decoder from them): the grammar starts after
    them. It is not part of the grammar (nor of its cache key)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # a list is taken too
    grammar: str | None = None
    json_object: bool = False
    resumed_output_tokens: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.json is not None:
            object.__setattr__(self, "json", _canonical_json(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_fields = [
            f.name for f in fields(self) if f.compare and getattr(self, f.name) not in (None, False)
        ]
        if len(set_fields) != 1:
            raise InvalidRequestError(
                f"structured outputs take exactly one of json, json_object, regex, choice, grammar; got {set_fields or 'none'}",
                param="structured_outputs",
            )

    @property
    def kind(self) -> StructureKind:
        if self.json is not None:
            return StructureKind.JSON
        if self.regex is not None:
            return StructureKind.REGEX
        if self.choice is not None:
            return StructureKind.CHOICE
        if self.grammar is not None:
            return StructureKind.GRAMMAR
        return StructureKind.JSON_OBJECT

    def validate(self, param: str = "structured_outputs") -> None:
        """InvalidRequestError naming ``param`` unless the grammar compiles."""
        ok = isinstance(self.resumed_output_tokens, int) and self.resumed_output_tokens >= 0
        if not ok:
            raise InvalidRequestError("must be a non-negative integer", param="resumed_output_tokens")
        error = _grammar_error(self)
        if error:
            raise InvalidRequestError(
                f"invalid {self.kind.value} for structured outputs: {error}", param=param
            )


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The spec as an llguidance grammar (the text an LLMatcher compiles); ValueError when a
    schema is not JSON or a grammar cannot be converted."""
    from llguidance import LLMatcher, grammar_from

    kind = spec.kind
    if kind is StructureKind.JSON:
        assert isinstance(spec.json, str)
        # compact JSON: no whitespace between tokens, so an answer cannot run on in blanks
        return LLMatcher.grammar_from_json_schema(
            _schema_object(spec.json), defaults={"whitespace_flexible": False}
        )
    if kind is StructureKind.JSON_OBJECT:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
    if kind is StructureKind.REGEX:
        assert spec.regex is not None
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind is StructureKind.CHOICE:
        assert spec.choice is not None
        if not spec.choice or not all(isinstance(c, str) and c for c in spec.choice):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return grammar_from("choice", json.dumps(list(spec.choice)))
    assert spec.grammar is not None
    return grammar_from("grammar", spec.grammar)


def _canonical_json(schema: str | dict[str, Any]) -> str:
    """The schema as compact JSON with sorted keys (one cache key per schema); text that is
    not JSON is kept as it is, for validate() to refuse."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError:
            return schema
    else:
        parsed = schema
    return json.dumps(parsed, sort_keys=True, separators=(",", ":"))


def _schema_object(text: str) -> dict[str, Any]:
    schema = json.loads(text)
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object")
    return schema


@functools.lru_cache(maxsize=256)
def _grammar_error(spec: StructuredOutputsParams) -> str:
    """Why the spec does not compile ('' when it does); cached: the front end, the engine
    core and the worker each check the same spec."""
    from llguidance import LLMatcher

    try:
        text = grammar_text(spec)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return LLMatcher.validate_grammar(text)
