"""The proxy's edge: a client's body is read and checked with the instances' own rules (the
same size limit, strict JSON and request models, kvferry/entrypoints/edge.py), so what an
instance would refuse is refused here up front, with the same status and body, before any
leg starts or a stream commits to HTTP 200."""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import Request

from kvferry.entrypoints.edge import BodyDecoder, parse_model
from kvferry.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvferry.entrypoints.proxy.pd import CHAT, COMPLETIONS
from kvferry.errors import InvalidRequestError


async def checked_body(request: Request, path: str, decoder: BodyDecoder) -> dict[str, Any]:
    """The client's body (to forward as sent) once it passed the instances' checks (in a
    worker thread when large: see kvferry/entrypoints/edge.py)."""
    body: dict[str, Any] = await decoder.read(request, partial(_check, path))
    return body


def _check(path: str, body: Any) -> Any:
    if path == COMPLETIONS:
        completion = parse_model(CompletionRequest, body)
        completion.prompts()
        completion.to_sampling_params()
    elif path == CHAT:
        parse_model(ChatCompletionRequest, body).to_sampling_params()
    if not isinstance(body, dict):  # what the request models parse: a JSON object
        raise InvalidRequestError("the request body must be a JSON object")
    return body
