"""POST /v1/completions: one prompt or a batch, streamed (SSE) or not."""

from __future__ import annotations

import copy
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvferry.entrypoints.http_common import ClientDisconnected, until_disconnect
from kvferry.entrypoints.openai.protocol import CompletionRequest
from kvferry.entrypoints.openai.serving_common import (
    CLIENT_CLOSED_STATUS,
    SSE_DONE,
    ServerState,
    final_outputs,
    first_outputs,
    merge,
    sse,
    sse_error,
    token_text,
    usage,
)
from kvferry.outputs import RequestOutput
from kvferry.worker.output import SampleLogprobs

logger = logging.getLogger(__name__)


def completion_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[SampleLogprobs], offset: int = 0
) -> dict[str, Any]:
    """OpenAI's legacy logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in zip(token_ids, logprobs):
        text = token_text(tokenizer, tid)
        tokens.append(text)
        token_lps.append(lp.sampled)
        tops.append({token_text(tokenizer, t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


class _Choice:
    """Per-prompt state of a streamed completion."""

    def __init__(self) -> None:
        self.offset = 0
        self.final: RequestOutput | None = None


async def create_completion(body: CompletionRequest, request: Request, state: ServerState) -> Response:
    model = state.check_model(body.model)
    params = body.to_sampling_params()
    prompts = body.prompts()
    request_id = f"cmpl-{uuid.uuid4().hex}"
    gens = [
        state.engine.generate(prompt, copy.copy(params), f"{request_id}-{i}", body.kv_transfer_params)
        for i, prompt in enumerate(prompts)
    ]
    meta = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
    try:
        if body.stream:
            firsts = await until_disconnect(request, first_outputs(gens))
            events = _stream(state, body, meta, firsts, gens)
            return StreamingResponse(events, media_type="text/event-stream")
        finals = await until_disconnect(request, final_outputs(gens))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    return JSONResponse(_response(state, body, meta, finals))


def _response(state: ServerState, body: CompletionRequest, meta: dict, finals: list[RequestOutput]) -> dict:
    choices = []
    for i, out in enumerate(finals):
        comp = out.outputs[0]
        lps = None
        if body.logprobs is not None and comp.logprobs is not None:
            lps = completion_logprobs(state.engine.tokenizer, comp.token_ids, comp.logprobs)
        choices.append(
            {
                "index": i,
                "text": comp.text,
                "logprobs": lps,
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
            }
        )
    result = {**meta, "choices": choices, "usage": usage(finals)}
    kv = [o.kv_transfer_params for o in finals if o.kv_transfer_params is not None]
    if kv:
        result["kv_transfer_params"] = kv[0] if len(finals) == 1 else kv
    return result


async def _stream(
    state: ServerState,
    body: CompletionRequest,
    meta: dict,
    firsts: list[RequestOutput],
    gens: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[str]:
    choices = [_Choice() for _ in gens]
    try:
        async for i, out in merge(firsts, gens):
            chunk = _chunk(state, body, meta, i, out, choices[i])
            if chunk is not None:
                yield sse(chunk)
        if body.include_usage:
            finals = [c.final for c in choices if c.final is not None]
            yield sse({**meta, "choices": [], "usage": usage(finals)})
    except Exception as exc:  # the request failed in the engine: tell the client in-stream
        logger.warning("completion stream %s failed: %s", meta["id"], exc)
        yield sse_error(exc)
    yield SSE_DONE


def _chunk(
    state: ServerState, body: CompletionRequest, meta: dict, index: int, out: RequestOutput, choice: _Choice
) -> dict | None:
    comp = out.outputs[0]
    reason = comp.finish_reason if out.finished else None
    lps = None
    if body.logprobs is not None and out.delta_logprobs:
        lps = completion_logprobs(
            state.engine.tokenizer, out.delta_token_ids, out.delta_logprobs, choice.offset
        )
    choice.offset += len(out.delta_text)
    if out.finished:
        choice.final = out
    if not out.delta_text and reason is None and lps is None:
        return None
    payload = {"index": index, "text": out.delta_text, "logprobs": lps, "finish_reason": reason}
    if reason is not None:
        payload["stop_reason"] = comp.stop_reason
    chunk: dict[str, Any] = {**meta, "choices": [payload]}
    if out.finished and out.kv_transfer_params is not None:
        chunk["kv_transfer_params"] = out.kv_transfer_params
    return chunk
