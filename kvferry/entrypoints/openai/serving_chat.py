"""POST /v1/chat/completions: the chat template, then one generation, streamed (SSE) or not."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvferry.entrypoints.http_common import ClientDisconnected, until_disconnect
from kvferry.entrypoints.openai.protocol import ChatCompletionRequest
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


def _logprob_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[SampleLogprobs]) -> dict[str, Any]:
    """OpenAI's chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for tid, lp in zip(token_ids, logprobs):
        entry = _logprob_entry(tokenizer, tid, lp.sampled)
        entry["top_logprobs"] = [_logprob_entry(tokenizer, t, v) for t, v in lp.top]
        content.append(entry)
    return {"content": content}


async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: ServerState
) -> Response:
    model = state.check_model(body.model)
    params = body.to_sampling_params()
    engine = state.engine
    prompt = engine.input_processor.apply_chat_template(body.template_messages(), body.add_generation_prompt)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    gens = [engine.generate(prompt, params, request_id, body.kv_transfer_params)]
    meta = {"id": request_id, "created": int(time.time()), "model": model}
    try:
        if body.stream:
            firsts = await until_disconnect(request, first_outputs(gens))
            return StreamingResponse(_stream(state, body, meta, firsts, gens), media_type="text/event-stream")
        (final,) = await until_disconnect(request, final_outputs(gens))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    return JSONResponse(_response(state, body, meta, final))


def _response(state: ServerState, body: ChatCompletionRequest, meta: dict, final: RequestOutput) -> dict:
    comp = final.outputs[0]
    lps = None
    if body.logprobs and comp.logprobs is not None:
        lps = chat_logprobs(state.engine.tokenizer, comp.token_ids, comp.logprobs)
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": comp.text},
        "logprobs": lps,
        "finish_reason": comp.finish_reason,
        "stop_reason": comp.stop_reason,
    }
    result = {**meta, "object": "chat.completion", "choices": [choice], "usage": usage([final])}
    if final.kv_transfer_params is not None:
        result["kv_transfer_params"] = final.kv_transfer_params
    return result


async def _stream(
    state: ServerState,
    body: ChatCompletionRequest,
    meta: dict,
    firsts: list[RequestOutput],
    gens: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[str]:
    meta = {**meta, "object": "chat.completion.chunk"}
    final = None
    try:
        yield sse({**meta, "choices": [_choice({"role": "assistant", "content": ""})]})
        async for _, out in merge(firsts, gens):
            chunk = _chunk(state, body, meta, out)
            if out.finished:
                final = out
            if chunk is not None:
                yield sse(chunk)
        if body.include_usage and final is not None:
            yield sse({**meta, "choices": [], "usage": usage([final])})
    except Exception as exc:  # the request failed in the engine: tell the client in-stream
        logger.warning("chat stream %s failed: %s", meta["id"], exc)
        yield sse_error(exc)
    yield SSE_DONE


def _choice(delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
    return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def _chunk(state: ServerState, body: ChatCompletionRequest, meta: dict, out: RequestOutput) -> dict | None:
    reason = out.outputs[0].finish_reason if out.finished else None
    lps = None
    if body.logprobs and out.delta_logprobs:
        lps = chat_logprobs(state.engine.tokenizer, out.delta_token_ids, out.delta_logprobs)
    if not out.delta_text and reason is None and lps is None:
        return None
    delta = {"content": out.delta_text} if out.delta_text or lps is not None else {}
    choice = _choice(delta, lps, reason)
    if reason is not None:
        choice["stop_reason"] = out.outputs[0].stop_reason
    chunk: dict[str, Any] = {**meta, "choices": [choice]}
    if out.finished and out.kv_transfer_params is not None:
        chunk["kv_transfer_params"] = out.kv_transfer_params
    return chunk
