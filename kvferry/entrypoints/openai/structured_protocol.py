"""Structured-output fields of OpenAI request bodies, and their translation to a
StructuredOutputsParams (kvferry/structured/params.py).

Forms taken: OpenAI's ``response_format`` (``{"type": "json_object"}``, ``{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}``; ``"text"`` is no
constraint), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) and its older ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``. One form per request; a spec that does not compile is a 400 naming the
field it came in.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvferry.errors import InvalidRequestError
from kvferry.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_STRICT = ConfigDict(extra="ignore", strict=True)


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = _STRICT

    name: str = Field(min_length=1)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's ``structured_outputs`` object."""

    model_config = _STRICT

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, fail_fast=True)
    grammar: str | None = None
    json_object: bool | None = None


class StructuredOutputsFields(BaseModel):
    """The request fields; a request body model inherits them."""

    model_config = _STRICT

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, fail_fast=True)
    guided_grammar: str | None = None
    # extra: the prompt's last N tokens are the answer so far (the P/D proxy's failover
    # continues an answer on another decoder from them): the grammar resumes after them
    resumed_output_tokens: Annotated[int, Field(ge=0, le=2**31)] = 0

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one structured-output spec the body asks for (validated), or None."""
        specs = [(name, spec) for name, spec in self._specs() if spec is not None]
        if len(specs) > 1:
            names = ", ".join(name for name, _ in specs)
            raise InvalidRequestError(f"give one structured-output form, not {names}", param=specs[1][0])
        if not specs:
            return None
        name, spec = specs[0]
        spec.validate(param=name)
        return dataclasses.replace(spec, resumed_output_tokens=self.resumed_output_tokens)

    def _specs(self) -> list[tuple[str, StructuredOutputsParams | None]]:
        return [
            ("response_format", _from_response_format(self.response_format)),
            ("structured_outputs", _from_body(self.structured_outputs)),
            ("guided_json", _build("guided_json", json=self.guided_json)),
            ("guided_regex", _build("guided_regex", regex=self.guided_regex)),
            ("guided_choice", _build("guided_choice", choice=self.guided_choice)),
            ("guided_grammar", _build("guided_grammar", grammar=self.guided_grammar)),
        ]


def _build(param: str, **field: Any) -> StructuredOutputsParams | None:
    """The spec with ``field`` set, or None when its value is None."""
    (name, value), *_ = field.items()
    if value is None:
        return None
    if name == "choice":
        value = tuple(value)
    try:
        return StructuredOutputsParams(**{name: value})
    except InvalidRequestError as exc:
        raise InvalidRequestError(exc.message, param=param) from exc


def _from_response_format(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None:
        raise InvalidRequestError(
            "response_format of type json_schema needs a json_schema object", param="response_format"
        )
    schema = fmt.json_schema.schema_
    return StructuredOutputsParams(json=schema if schema is not None else {"type": "object"})


def _from_body(body: StructuredOutputsBody | None) -> StructuredOutputsParams | None:
    if body is None:
        return None
    fields = {
        "json": body.json_,
        "regex": body.regex,
        "choice": tuple(body.choice) if body.choice is not None else None,
        "grammar": body.grammar,
        "json_object": bool(body.json_object),
    }
    set_fields = {name: value for name, value in fields.items() if value not in (None, False)}
    if len(set_fields) != 1:
        raise InvalidRequestError(
            "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
            param="structured_outputs",
        )
    return _build("structured_outputs", **set_fields)
