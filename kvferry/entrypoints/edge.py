"""The HTTP edge shared by the OpenAI server and the P/D proxy: how a request body is read,
decoded and checked before any handler sees it, so both refuse the same inputs the same way.

    body = await read_json(request, limits)      # bytes -> JSON value, or a typed error
    req = parse_model(CompletionRequest, body)   # the pydantic model, or a typed error

Every refusal is an ``InvalidRequestError`` (HTTP 400) or ``RequestTooLargeError`` (413):
a body over the size limit, a content type that is not JSON, bytes that are not UTF-8,
malformed JSON, NaN or Infinity, an integer outside int64, a lone surrogate in a string,
nesting deeper than the limit, or a value the model's fields refuse.

Kept free of engine imports so the proxy starts without torch.
"""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from kvferry.entrypoints.edge_options import DEFAULT_MAX_JSON_DEPTH, EdgeLimits
from kvferry.errors import InvalidRequestError
from kvferry.sampling_params import INT64_MAX, INT64_MIN

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

_MAX_INT_DIGITS = 20  # int64 has at most 19 digits: longer literals are refused unparsed


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than the server accepts: HTTP 413."""

    status_code = 413


async def read_json(request: Request, limits: EdgeLimits) -> Any:
    """The request's body as a JSON value, checked (see the module docstring)."""
    check_content_type(request.headers.get("content-type"))
    raw = await read_body(request, limits.max_body_bytes)
    return parse_json(raw, limits.max_json_depth)


def check_content_type(content_type: str | None) -> None:
    """JSON bodies only: no header, ``application/json`` or a ``+json`` type."""
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise InvalidRequestError(
        f"the request body must be JSON (Content-Type: application/json), not {media!r}"
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, refused (413) as soon as it is known to exceed ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> RequestTooLargeError:
    return RequestTooLargeError(f"the request body is larger than the limit of {max_bytes} bytes")


def parse_json(raw: bytes, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, integers within int64, no lone surrogates,
    nesting at most ``max_depth`` deep."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid UTF-8: {exc.reason}") from exc
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_int=_int64)
    except RecursionError as exc:
        raise InvalidRequestError(f"JSON nested deeper than {max_depth} levels") from exc
    except ValueError as exc:
        if isinstance(exc, InvalidRequestError):
            raise
        raise InvalidRequestError(f"malformed JSON body: {exc}") from exc
    check_value(value, max_depth)
    return value


def _refuse_constant(name: str) -> Any:
    raise InvalidRequestError(f"{name} is not a valid JSON number")


def _int64(literal: str) -> int:
    digits = literal.lstrip("-")
    if len(digits) > _MAX_INT_DIGITS:
        raise InvalidRequestError(f"integer {literal[:24]}... is outside the 64-bit range")
    value = int(literal)
    if not INT64_MIN <= value <= INT64_MAX:
        raise InvalidRequestError(f"integer {literal} is outside the 64-bit range")
    return value


def check_value(value: Any, max_depth: int) -> None:
    """Refuse nesting deeper than ``max_depth`` and strings (values or keys) that are not
    encodable text (lone surrogates). Iterative: deep input cannot exhaust the stack."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, dict | list):
            if depth > max_depth:
                raise InvalidRequestError(f"JSON nested deeper than {max_depth} levels")
            if isinstance(item, dict):
                for key in item:
                    _check_text(key)
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError("strings must be valid Unicode (a lone surrogate was found)") from exc


def parse_model(model: type[M], value: Any) -> M:
    """``value`` as ``model``; a refusal names the first offending field."""
    if not isinstance(value, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise InvalidRequestError(message, param=param) from exc


_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _field_path(loc: tuple[int | str, ...]) -> list[str]:
    """The field path of a pydantic error location, without 'body' and union member tags."""
    path = []
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        text = str(part)
        if text in _UNION_TAGS or "[" in text or text[:1].isupper() or text.startswith("function-"):
            break
        path.append(text)
    return path


def _union_members(errors: list[Any], param: str) -> str:
    """The union members pydantic tried, from its error locations: "str, list[int], ..."."""
    depth = param.count(".") + 1
    members = [str(loc[depth]) for e in errors if len(loc := tuple(e.get("loc", ()))) > depth]
    names = [m.replace("constrained-int", "int") for m in dict.fromkeys(members)]
    return ", ".join(names)


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """(message, param) for pydantic's error list: its first error, with the field named."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('msg', '')}", None
    param = ".".join(_field_path(first.get("loc", ()))) or None
    msg = first.get("msg", "invalid value")
    same_field = {".".join(_field_path(e.get("loc", ()))) for e in errors} == {param}
    if param and len(errors) > 1 and same_field:  # a union: every accepted form failed
        return f"{param} has none of the accepted forms ({_union_members(errors, param)})", param
    where = f" ({param})" if param else ""
    return f"{msg}{where}", param
