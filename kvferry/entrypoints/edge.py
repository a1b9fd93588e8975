"""The HTTP edge shared by the OpenAI server and the P/D proxy: how a request body is read,
decoded and checked before any handler sees it, so both refuse the same inputs the same way.

    decoder = BodyDecoder(limits)                               # one per app
    req = await decoder.read(request, partial(parse_model, CompletionRequest))
    body = await decoder.read(request)                          # the JSON value itself

Every refusal is an ``InvalidRequestError`` (HTTP 400) or ``RequestTooLargeError`` (413):
a body over the size limit, a content type that is not JSON, bytes that are not UTF-8,
more JSON values than the limit, malformed JSON, NaN or Infinity, an integer outside int64,
a lone surrogate in a string, nesting deeper than the limit, or a value the model's fields
refuse. A client that leaves while its body is read is one log line and
``ClientDisconnected`` (the caller answers 499, nginx's "client closed request").

Decoding costs CPU in proportion to the number of JSON values, not bytes: 4 million integers
in 8 MB took 15 s to parse and check (2026-11-27, 3c0034b, AMD EPYC, 2 vCPU, AVX2, loaded host),
stalling every other request of the event loop meanwhile. So bodies above
``INLINE_DECODE_BYTES`` are decoded in a worker thread (at most ``DECODE_WORKERS`` at once),
and the number of values is capped (``EdgeLimits.max_json_values``) by counting the bytes
that may start one, before any parsing. A thread shares the GIL: the parse's Python-level
steps (each integer and float goes through a Python hook) let the event loop run every few
milliseconds, and the cap bounds the parts that cannot (the C parser's lists and strings,
pydantic's validation): see docs/security.md for the figures.

Kept free of engine imports so the proxy starts without torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from kvferry.entrypoints.edge_options import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_JSON_VALUES, EdgeLimits
from kvferry.entrypoints.http_common import ClientDisconnected
from kvferry.errors import InvalidRequestError
from kvferry.sampling_params import INT64_MAX, INT64_MIN

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

_MAX_INT_DIGITS = 20  # int64 has at most 19 digits: longer literals are refused unparsed
# Smaller bodies decode on the event loop, larger ones in a worker thread. The costliest
# 8 KiB (4,096 token ids) took 16 ms to decode and check on a loaded host (4 ms unloaded);
# a usual chat request is well under it (2026-11-27, 3c0034b, AMD EPYC, 2 vCPU, AVX2).
INLINE_DECODE_BYTES = 8 * 1024
# Decoding holds the GIL most of the time: more threads than this add no throughput, only
# more contenders for the GIL the event loop needs; further bodies wait their turn.
DECODE_WORKERS = 2
_VALUE_STARTS = (b",", b":", b"[", b"{")  # every JSON value but the first follows one of these
_COUNT_CHUNK = 256 * 1024  # counted a slice at a time, so the count lets other threads run


class RequestTooLargeError(InvalidRequestError):
    """The request body is larger than the server accepts: HTTP 413."""

    status_code = 413


def _identity(value: Any) -> Any:
    return value


class BodyDecoder:
    """Reads request bodies within ``limits`` and decodes them (JSON, then a caller's check
    such as ``parse_model``): on the event loop when small, in a worker thread otherwise."""

    def __init__(self, limits: EdgeLimits | None = None) -> None:
        self.limits = limits or EdgeLimits()
        self._workers = ThreadPoolExecutor(DECODE_WORKERS, thread_name_prefix="kvferry-body")

    async def read(self, request: Request, check: Callable[[Any], T] = _identity) -> T:
        """The body, checked as JSON (see the module docstring), passed through ``check``."""
        check_content_type(request.headers.get("content-type"))
        raw = await read_body(request, self.limits.max_body_bytes)
        decode = partial(decode_json, raw, self.limits, check)
        if len(raw) <= INLINE_DECODE_BYTES:
            return decode()
        return await asyncio.get_running_loop().run_in_executor(self._workers, decode)

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)


def decode_json(raw: bytes, limits: EdgeLimits, check: Callable[[Any], T] = _identity) -> T:
    """``check`` of the JSON value of ``raw``, within ``limits`` (blocking: see BodyDecoder)."""
    check_value_count(raw, limits.max_json_values)
    return check(parse_json(raw, limits.max_json_depth))


async def read_json(request: Request, limits: EdgeLimits) -> Any:
    """The request's body as a JSON value, checked, decoded on the event loop: for tests and
    small bodies; the apps use BodyDecoder."""
    check_content_type(request.headers.get("content-type"))
    return decode_json(await read_body(request, limits.max_body_bytes), limits)


def check_value_count(raw: bytes, max_values: int = DEFAULT_MAX_JSON_VALUES) -> None:
    """Refuse a body that may hold more than ``max_values`` JSON values, before parsing it:
    an upper bound (each value but the first follows one of ``, : [ {``; inside strings too)."""
    count = 1
    for start in range(0, len(raw), _COUNT_CHUNK):
        count += sum(raw.count(c, start, start + _COUNT_CHUNK) for c in _VALUE_STARTS)
        if count > max_values:
            raise InvalidRequestError(
                f"the request body holds more than {max_values} JSON values (counting each , : [ {{)"
            )


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
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        # One line, not an error: a client that gives up (or a slowloris) is not our failure.
        of = f" of {declared}" if declared is not None else ""
        logger.info(
            "%s %s: the client left after %d%s bytes of its body", request.method, request.url.path, size, of
        )
        raise ClientDisconnected() from None
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
        # Python hooks for numbers: they check int64 and let other threads have the GIL.
        value = json.loads(text, parse_constant=_refuse_constant, parse_int=_int64, parse_float=_float)
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


def _float(literal: str) -> float:
    return float(literal)


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


def check_prompt_lengths(value: Any, max_model_len: int) -> Any:
    """``value``, once no prompt in it given as token ids (``prompt``, or chat's
    ``prompt_token_ids``) is too long for the model's context: refused here, by its length,
    before the ids are validated one by one. Other shapes are left to the model."""
    if not isinstance(value, dict):
        return value
    prompt = value.get("prompt")
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
    id_lists = [p for p in [*batch, value.get("prompt_token_ids")] if isinstance(p, list)]
    for ids in id_lists:
        if ids and not isinstance(ids[0], str) and len(ids) >= max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{len(ids)} tokens (at least one token must be left to generate).",
                param="prompt",
            )
    return value


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
