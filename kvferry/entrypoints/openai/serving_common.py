"""What the completion and chat handlers share: the request flow (streamed or not, client
disconnects), SSE framing and errors, choice and chunk shapes, usage, batches of prompts."""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvferry.engine.async_engine import AsyncEngine
from kvferry.engine.parallel_sampling import (
    best_children,
    child_params,
    child_streams,
    num_children,
    ranks_children,
)
from kvferry.entrypoints.http_common import (
    CLIENT_CLOSED_STATUS,
    SSE_DONE,
    ClientDisconnected,
    gather_or_cancel,
    interleave,
    sse,
    until_disconnect,
)
from kvferry.entrypoints.openai.errors import exception_body
from kvferry.errors import InvalidRequestError, ModelNotFoundError
from kvferry.messages.kv_connector import KVTransferParams
from kvferry.outputs import RequestOutput
from kvferry.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

T = TypeVar("T")

Streams = list[AsyncIterator[RequestOutput]]  # one generate() stream per prompt


@dataclass(frozen=True)
class ServerState:
    engine: AsyncEngine
    served_model_name: str
    aliases: tuple[str, ...] = ()  # other names a request may use (the model argument as given)

    def check_model(self, requested: str | None) -> str:
        """The model name to report (always the served one); unknown names are 404 as in OpenAI's API."""
        if requested is not None and requested != self.served_model_name and requested not in self.aliases:
            raise ModelNotFoundError(f"The model `{requested}` does not exist.", param="model")
        return self.served_model_name


# -- the request flow ---------------------------------------------------------------------


async def respond(
    request: Request,
    request_id: str,
    gens: Streams,
    stream: bool,
    stream_chunks: Callable[[list[RequestOutput]], AsyncIterator[dict[str, Any]]],
    response_body: Callable[[list[RequestOutput]], dict[str, Any]],
) -> Response:
    """Answer with SSE (``stream_chunks`` of the first outputs) or JSON (``response_body`` of the
    final ones). A failure before the first outputs is an HTTP error; one after them, an
    error event in the stream."""
    try:
        if stream:
            firsts = await until_disconnect(request, first_outputs(gens))
            events = sse_events(stream_chunks(firsts), request_id)
            return StreamingResponse(events, media_type="text/event-stream")
        finals = await until_disconnect(request, final_outputs(gens))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    return JSONResponse(response_body(finals))


async def sse_events(chunks: AsyncIterator[dict[str, Any]], request_id: str) -> AsyncIterator[str]:
    """``chunks`` as server-sent events, then [DONE]; an engine failure becomes an error event."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except Exception as exc:  # the request failed in the engine: tell the client in-stream
        logger.warning("stream %s failed: %s", request_id, exc)
        yield sse_error(exc)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE


def sse_error(exc: BaseException) -> str:
    _, body = exception_body(exc)
    return sse(body)


# -- response shapes ----------------------------------------------------------------------


def final_choice(index: int, content: dict[str, Any], logprobs: Any, out: RequestOutput) -> dict[str, Any]:
    """A choice of a complete response: ``content`` (text or message), logprobs, reasons."""
    comp = out.outputs[0]
    return {
        "index": index,
        **content,
        "logprobs": logprobs,
        "finish_reason": comp.finish_reason,
        "stop_reason": comp.stop_reason,
    }


def response_body(
    meta: dict[str, Any], choices: list[dict[str, Any]], finals: list[RequestOutput], per_prompt: int = 1
) -> dict[str, Any]:
    """A complete response: choices, usage and the KV transfer parameters (one, or a list)."""
    result = {**meta, "choices": choices, "usage": usage(finals, per_prompt)}
    kv = [o.kv_transfer_params for o in finals if o.kv_transfer_params is not None]
    if kv:
        result["kv_transfer_params"] = kv[0] if len(finals) == 1 else kv
    return result


def stream_chunk(
    meta: dict[str, Any],
    index: int,
    content: dict[str, Any],
    logprobs: Any,
    out: RequestOutput,
    has_token_ids: bool = False,
) -> dict[str, Any] | None:
    """A stream chunk with one choice; None when ``out`` brings nothing to send
    (``has_token_ids``: ``content`` carries more than the text, to be sent anyway).

    The last chunk of a choice carries its finish and stop reasons and the request's KV
    transfer parameters.
    """
    reason = out.outputs[0].finish_reason if out.finished else None
    if not out.delta_text and reason is None and logprobs is None and not has_token_ids:
        return None
    choice = {"index": index, **content, "logprobs": logprobs, "finish_reason": reason}
    if reason is not None:
        choice["stop_reason"] = out.outputs[0].stop_reason
    chunk: dict[str, Any] = {**meta, "choices": [choice]}
    if out.finished and out.kv_transfer_params is not None:
        chunk["kv_transfer_params"] = out.kv_transfer_params
    return chunk


def token_id_fields(wanted: bool, out: RequestOutput, new: list[int], with_prompt: bool) -> dict[str, Any]:
    """``token_ids`` (and, with ``with_prompt``, ``prompt_token_ids``) when ``wanted``."""
    if not wanted:
        return {}
    ids: dict[str, Any] = {"token_ids": new}
    if with_prompt:
        ids["prompt_token_ids"] = list(out.prompt_token_ids)
    return ids


def delta_token_id_fields(wanted: bool, out: RequestOutput, with_prompt: bool) -> dict[str, Any]:
    """A stream chunk's token-id fields: empty when ``out`` brings nothing new (no text, no
    token, not the end), so that such an output makes no chunk."""
    ids = token_id_fields(wanted, out, list(out.delta_token_ids), with_prompt)
    if ids and not out.delta_text and not ids["token_ids"] and not out.finished:
        return {}
    return ids


def usage(outputs: list[RequestOutput], per_prompt: int = 1) -> dict[str, Any]:
    """Usage of answers listed prompt by prompt, ``per_prompt`` each (n): a prompt counts once."""
    firsts = outputs[::per_prompt]
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs)
    cached = sum(o.num_cached_tokens for o in firsts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    text = tokenizer.decode([token_id])
    if not isinstance(text, str):  # a list: one text per sequence of a batch, not ours
        raise TypeError(f"the tokenizer decoded one token to {type(text).__name__}")
    return text


# -- several generate() streams -----------------------------------------------------------


def answer_streams(
    engine: AsyncEngine,
    prompts: list[tuple[str, str | list[int]]],
    params: SamplingParams,
    kv_transfer_params: KVTransferParams | None,
    stream: bool,
) -> Streams:
    """The generate() streams of a request's (request id, prompt)s: per prompt, one per
    child (n, best_of)."""
    if stream and ranks_children(params):
        raise InvalidRequestError("best_of > n is not supported with stream", param="best_of")
    count = num_children(params)
    gens: Streams = []
    for request_id, prompt in prompts:

        def open_child(
            c: int, rid: str = request_id, prompt: str | list[int] = prompt
        ) -> AsyncIterator[RequestOutput]:
            child_id = rid if count == 1 else f"{rid}-{c}"
            kv = kv_transfer_params if c == 0 else None  # the prompt's KV crosses once
            return engine.generate(prompt, copy.copy(child_params(params, c)), child_id, kv)

        gens.extend(child_streams(params, open_child))
    return gens


def chosen_answers(finals: list[RequestOutput], params: SamplingParams) -> list[RequestOutput]:
    """The answers returned, n per prompt, of every child's final output (prompt by prompt)."""
    count = num_children(params)
    chosen: list[RequestOutput] = []
    for start in range(0, len(finals), count):
        chosen.extend(best_children(finals[start : start + count], params))
    return chosen


async def final_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Drain a generate() stream and return its last output."""
    last = None
    async for out in gen:
        last = out
    if last is None:
        raise ClientDisconnected()  # aborted before any output
    return last


async def first_outputs(gens: Streams) -> list[RequestOutput]:
    """The first output of every stream, concurrently; all are closed if any fails.

    Streams submit their request on the first ``anext``, so this is where a bad prompt
    raises: before a streaming response commits to HTTP 200.
    """
    return await _all_or_none(gens, [anext(g) for g in gens])


async def final_outputs(gens: Streams) -> list[RequestOutput]:
    """The last output of every stream, concurrently; all are closed if any fails."""
    return await _all_or_none(gens, [final_output(g) for g in gens])


async def _all_or_none(gens: Streams, work: list[Awaitable[T]]) -> list[T]:
    try:
        return await gather_or_cancel(work)
    except BaseException:
        await close_all(gens)
        raise


async def close_all(gens: Streams) -> None:
    for g in gens:
        try:
            await g.aclose()  # type: ignore[attr-defined]
        except Exception:
            logger.exception("closing a generate() stream failed")


async def merge(firsts: list[RequestOutput], gens: Streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams (a batch of prompts) as (index, output)."""
    try:
        for i, first in enumerate(firsts):
            yield i, first
        live = [(i, gens[i]) for i, first in enumerate(firsts) if not first.finished]
        async for item in interleave(live):
            yield item
    finally:
        await close_all(gens)
