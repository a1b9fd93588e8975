"""POST /v1/chat/completions: the chat template, then one generation, streamed (SSE) or not.

Extras: ``prompt_token_ids`` is the prompt as token ids instead of the messages' template,
and ``return_token_ids`` has choices carry ``token_ids`` (and ``prompt_token_ids`` once),
as for completions: together they let the P/D proxy continue a chat answer on another
decoder from exactly the tokens already sent. With ``resumed_output_tokens`` (the
prompt's last tokens are the answer so far) a streamed answer's tool-call parse starts
where the answer stands, so its deltas go on as the undisturbed stream's would
(answer_calls.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from kvferry.entrypoints.http_common import chat_role_chunk
from kvferry.entrypoints.openai import serving_common as common
from kvferry.entrypoints.openai.answer_calls import CallsStream, calls_delta, calls_stream, resumed_answer
from kvferry.entrypoints.openai.auto_tool_stream import ToolCallFormat
from kvferry.entrypoints.openai.protocol import ChatCompletionRequest
from kvferry.entrypoints.openai.serving_common import ServerState, Streams
from kvferry.entrypoints.openai.serving_completions import prompt_logprobs_json
from kvferry.entrypoints.openai.tools import parse_answer
from kvferry.messages.model_runner import SampleLogprobs
from kvferry.outputs import RequestOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _logprob_entry(tokenizer: PreTrainedTokenizerBase, token_id: int, logprob: float) -> dict[str, Any]:
    text = common.token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int], logprobs: list[SampleLogprobs]
) -> dict[str, Any]:
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
    prompt = await _prompt(body, state)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    gens = common.answer_streams(engine, [(request_id, prompt)], params, body.kv_transfer_params, body.stream)
    meta = {"id": request_id, "created": int(time.time()), "model": model}
    return await common.respond(
        request,
        request_id,
        gens,
        body.stream,
        lambda firsts: _chunks(state, body, meta, firsts, gens),
        lambda finals: _response(state, body, meta, common.chosen_answers(finals, params)),
    )


async def _prompt(body: ChatCompletionRequest, state: ServerState) -> str | list[int]:
    if body.prompt_token_ids is not None:
        return list(body.prompt_token_ids)
    return await asyncio.to_thread(  # a long conversation takes a while: off the event loop
        state.engine.input_processor.apply_chat_template,
        body.template_messages(),
        body.add_generation_prompt,
        body.template_tools(),
    )


def _message(state: ServerState, body: ChatCompletionRequest, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant's message (content, and tool calls parsed from the text when the
    request has tools) and whether it calls tools."""
    if not body.uses_tools:
        return {"role": "assistant", "content": text}, False
    parsed = parse_answer(text, body, ToolCallFormat.of_template(state.engine.tokenizer.chat_template))
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
    return message, bool(parsed.tool_calls)


def _response(
    state: ServerState, body: ChatCompletionRequest, meta: dict[str, Any], finals: list[RequestOutput]
) -> dict[str, Any]:
    choices = []
    for index, final in enumerate(finals):
        comp = final.outputs[0]
        lps = None
        if body.logprobs and comp.logprobs is not None:
            lps = chat_logprobs(state.engine.tokenizer, comp.token_ids, comp.logprobs)
        message, calls = _message(state, body, comp.text)
        ids = common.token_id_fields(body.return_token_ids, final, list(comp.token_ids), True)
        choice = common.final_choice(index, {"message": message, **ids}, lps, final)
        if calls and choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"
        choices.append(choice)
    result = common.response_body({**meta, "object": "chat.completion"}, choices, finals, body.n)
    return {**result, **_prompt_logprobs_field(finals[0])}


def _prompt_logprobs_field(out: RequestOutput) -> dict[str, Any]:
    """vLLM's chat shape: the prompt's logprobs once, at the top of the response (or, streamed,
    of the first chunk), when asked."""
    if out.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}


async def _chunks(
    state: ServerState,
    body: ChatCompletionRequest,
    meta: dict[str, Any],
    firsts: list[RequestOutput],
    gens: Streams,
) -> AsyncIterator[dict[str, Any]]:
    meta = {**meta, "object": "chat.completion.chunk"}
    for index in range(len(gens)):  # one answer per stream (n; best_of > n is not streamed)
        role = chat_role_chunk(meta)
        role["choices"][0]["index"] = index
        yield {**role, **_prompt_logprobs_field(firsts[0])} if index == 0 else role
    finals: dict[int, RequestOutput] = {}
    sent_prompt_ids: set[int] = set()
    calls: dict[int, CallsStream] = {}  # each answer's calls, parsed as it grows
    async for index, out in common.merge(firsts, gens):
        if out.finished:
            finals[index] = out
        lps = None
        if body.logprobs and out.delta_logprobs:
            lps = chat_logprobs(state.engine.tokenizer, out.delta_token_ids, out.delta_logprobs)
        delta: dict[str, Any] = {"content": out.delta_text} if out.delta_text or lps is not None else {}
        ids = common.delta_token_id_fields(body.return_token_ids, out, index not in sent_prompt_ids)
        if body.uses_tools:
            if index not in calls:
                calls[index] = _open_calls(state, body, out)
            delta = calls_delta(calls[index], out.delta_text, out.finished)
        chunk = common.stream_chunk(meta, index, {"delta": delta, **ids}, lps, out, bool(ids))
        called = index in calls and bool(calls[index].calls)
        if chunk is not None and called and chunk["choices"][0]["finish_reason"] == "stop":
            chunk["choices"][0]["finish_reason"] = "tool_calls"
        if chunk is not None:
            if ids:
                sent_prompt_ids.add(index)
            yield chunk
    if body.include_usage and finals:
        yield {**meta, "choices": [], "usage": common.usage([finals[i] for i in sorted(finals)], body.n)}


def _open_calls(state: ServerState, body: ChatCompletionRequest, out: RequestOutput) -> CallsStream:
    """The parse of one streamed answer with tools, from where a resumed answer stands
    (``resumed_output_tokens``: the prompt's last tokens are the answer so far)."""
    tokenizer = state.engine.tokenizer
    count = body.resumed_output_tokens
    resumed = resumed_answer(tokenizer, out.prompt_token_ids, count, body.skip_special_tokens)
    return calls_stream(body, ToolCallFormat.of_template(tokenizer.chat_template), resumed)
