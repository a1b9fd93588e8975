"""POST /v1/completions: one prompt or a batch, streamed (SSE) or not."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from kvferry.entrypoints.openai import serving_common as common
from kvferry.entrypoints.openai.protocol import CompletionRequest
from kvferry.entrypoints.openai.serving_common import ServerState, Streams
from kvferry.messages.model_runner import SampleLogprobs
from kvferry.outputs import PromptLogprobsList, RequestOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def completion_logprobs(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int], logprobs: list[SampleLogprobs], offset: int = 0
) -> dict[str, Any]:
    """OpenAI's legacy logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in zip(token_ids, logprobs):
        text = common.token_text(tokenizer, tid)
        tokens.append(text)
        token_lps.append(lp.sampled)
        tops.append({common.token_text(tokenizer, t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(prompt_logprobs: PromptLogprobsList) -> list[dict[str, Any] | None]:
    """vLLM's JSON of prompt_logprobs: token ids as keys, {logprob, rank, decoded_token}."""
    return [
        None if entry is None else {str(token): dataclasses.asdict(lp) for token, lp in entry.items()}
        for entry in prompt_logprobs
    ]


class _Choice:
    """Per-prompt state of a streamed completion."""

    def __init__(self) -> None:
        self.offset = 0
        self.sent_prompt_ids = False
        self.sent_prompt_logprobs = False  # vLLM sends them in a choice's first chunk
        self.final: RequestOutput | None = None


async def create_completion(body: CompletionRequest, request: Request, state: ServerState) -> Response:
    model = state.check_model(body.model)
    params = body.to_sampling_params()
    prompts = body.prompts()
    request_id = f"cmpl-{uuid.uuid4().hex}"
    ids = [(f"{request_id}-{i}", prompt) for i, prompt in enumerate(prompts)]
    gens = common.answer_streams(state.engine, ids, params, body.kv_transfer_params, body.stream)
    meta = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
    return await common.respond(
        request,
        request_id,
        gens,
        body.stream,
        lambda firsts: _chunks(state, body, meta, firsts, gens),
        lambda finals: _response(state, body, meta, common.chosen_answers(finals, params)),
    )


def _response(
    state: ServerState, body: CompletionRequest, meta: dict[str, Any], finals: list[RequestOutput]
) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(finals):
        comp = out.outputs[0]
        lps = None
        if body.logprobs is not None and comp.logprobs is not None:
            lps = completion_logprobs(state.engine.tokenizer, comp.token_ids, comp.logprobs)
        ids = common.token_id_fields(body.return_token_ids, out, list(comp.token_ids), True)
        content = {"text": comp.text, **ids}
        if out.prompt_logprobs is not None:
            content["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        choices.append(common.final_choice(i, content, lps, out))
    return common.response_body(meta, choices, finals, body.n)


async def _chunks(
    state: ServerState,
    body: CompletionRequest,
    meta: dict[str, Any],
    firsts: list[RequestOutput],
    gens: Streams,
) -> AsyncIterator[dict[str, Any]]:
    choices = [_Choice() for _ in gens]
    async for i, out in common.merge(firsts, gens):
        chunk = _chunk(state, body, meta, i, out, choices[i])
        if chunk is not None:
            yield chunk
    if body.include_usage:
        finals = [c.final for c in choices if c.final is not None]
        yield {**meta, "choices": [], "usage": common.usage(finals, body.n)}


def _chunk(
    state: ServerState,
    body: CompletionRequest,
    meta: dict[str, Any],
    index: int,
    out: RequestOutput,
    choice: _Choice,
) -> dict[str, Any] | None:
    lps = None
    if body.logprobs is not None and out.delta_logprobs:
        lps = completion_logprobs(
            state.engine.tokenizer, out.delta_token_ids, out.delta_logprobs, choice.offset
        )
    choice.offset += len(out.delta_text)
    if out.finished:
        choice.final = out
    ids = common.delta_token_id_fields(body.return_token_ids, out, not choice.sent_prompt_ids)
    content: dict[str, Any] = {"text": out.delta_text, **ids}
    if out.prompt_logprobs is not None and not choice.sent_prompt_logprobs:
        content["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
    chunk = common.stream_chunk(meta, index, content, lps, out, len(content) > 1)
    if chunk is not None:
        choice.sent_prompt_ids = choice.sent_prompt_ids or bool(ids)
        choice.sent_prompt_logprobs = choice.sent_prompt_logprobs or "prompt_logprobs" in content
    return chunk
