"""Streamed answers (SSE).

Per leg (one prompt): the prefill runs first. Its token's text goes to the client at once,
so the time to first token is the prefill's, whenever the decoder's answer is sure to
start with it: the decoder is handed the token (``first_token_id``; any sampling, seeded
or not) or, with no connector, decodes greedily. The decoder's stream follows with that
text dropped from its start. A layer-wise leg (layerwise.py) sends the decoder's request
with the prefill's: its token goes early if the prefill answers before the decoder's
stream opens (a kvferry decoder opens it with its first token).

The text is not sent early when it is incomplete (part of a character), when a stop
string could end the answer inside it, when no decode instance is healthy (the client
gets the 503 rather than a token and an in-stream error), for a chat request whose tools
make its answer calls the proxy cannot stream as a server would (``tool_choice`` ``auto``
or ``required``; ``none`` goes early as text, a named function as its call's first
``tool_calls`` entry: early_calls.py), or when logprobs are asked:
every chunk's logprobs then come from the decoder, which computes the first token's too,
instead of being spliced from two instances. In those cases the decoder's stream is
opened before the response starts (so its errors keep their HTTP status) and passed
through.

With n > 1 the prefiller samples one first token, which the decoder's first answer
(choice 0) outputs as its own; its siblings start after it (engine/parallel_sampling.py).
So choice 0's text goes early under the same rules, and is dropped from choice 0 of the
decoder's stream only; a chat stream opens with every choice's role chunk, as a colocated
server's does, and the decoder's role chunks are dropped.

A decoder lost mid-stream is replaced (with two decoders or more): each unfinished answer
continues on another decoder as an n = 1 request of its own, its chunks re-indexed to the
answer's choice (failover.py). Usage is then the leg's: the prompt once, every answer's
completion tokens.

A leg that ends before its decoder answered (the client left, a decoder failed) asks the
prefill instance to release the KV it keeps for the leg (see pd.py).

All chunks get the proxy's id and the client's choice index (prompt * n + answer, as a
colocated server numbers a batch); usage chunks are summed into one at the end. An error
after the response started is sent in-stream as an OpenAI error body, like the server
does, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from kvferry.entrypoints.http_common import SSE_DONE as SSE_DONE_EVENT
from kvferry.entrypoints.http_common import chat_role_chunk, gather_or_cancel, interleave, sse
from kvferry.entrypoints.proxy.early_calls import (
    call_arguments,
    early_with_tools,
    first_call,
    named_function,
    skip_sent,
    strip_calls,
)
from kvferry.entrypoints.proxy.errors import InstanceLostError, exception_event_body
from kvferry.entrypoints.proxy.failover import DECODER_LOST, SentChoices, is_role_chunk
from kvferry.entrypoints.proxy.pd import (
    CHAT,
    Prefilled,
    ProxyContext,
    answers_per_prompt,
    choice_index,
    decode_body,
    decoder_repeats_first_token,
    first_text,
    prefill_prompt_logprobs,
    release_abandoned,
    run_prefill,
    split_legs,
    stop_may_cut,
    sum_usage,
    wants_logprobs,
)
from kvferry.entrypoints.proxy.pool import InstancePool
from kvferry.entrypoints.proxy.prefix_index import RouteKey
from kvferry.entrypoints.proxy.upstream import SSE_DONE, UpstreamStream

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"  # an incomplete character: never stream it early


class StreamLeg:
    """One prompt's prefill, then its decoder stream (n answers: choices 0..n-1 of the leg)."""

    def __init__(
        self, ctx: ProxyContext, path: str, index: int, body: dict[str, Any], headers: dict[str, str]
    ) -> None:
        self.ctx = ctx
        self.path = path
        self.index = index
        self.body = body
        self.headers = headers
        self.prefill: Prefilled | None = None
        self.early: str | None = None  # choice 0's first text, sent before the decoder's stream
        self.named = named_function(body) if path == CHAT else None  # the function forced
        self.early_call: dict[str, Any] | None = None  # named: the early text as its call's first entry
        self.pending = ""  # early text still to drop from choice 0 of the decoder's stream
        self.first: UpstreamStream | None = None  # the decoder stream of all n answers
        self.streams: list[UpstreamStream] = []  # every decoder stream opened (closed at the end)
        self.answers = answers_per_prompt(body)
        self.sent = SentChoices(chat=path == CHAT, answers=self.answers)
        self.can_fail_over = len(ctx.decode.instances) > 1
        self.failed_over = False
        self.resumed_usage: dict[int, dict[str, Any]] = {}  # continuation's usage, by choice
        self.usage_sent = False
        self.roles_sent: set[int] = set()  # chat: choices whose role chunk the client got
        self.client_wants_ids = bool(body.get("return_token_ids"))
        self.prompt_logprobs: list[Any] | None = None  # the prefiller's, for the decoder's chunks
        self.prompt_logprobs_sent: set[int] = set()  # choices that got them (chat: index 0, once)
        self.opening: asyncio.Future[UpstreamStream] | None = None  # a streamed leg's decoder, opening

    async def prepare(self, allow_early: bool) -> None:
        self.prefill = await run_prefill(self.ctx, self.path, self.body, self.headers)
        if self.prefill.answer is not None:
            await self._prepare_streamed(allow_early and self.named is None, self.prefill.answer)
            return
        self.prompt_logprobs = prefill_prompt_logprobs(self.path, self.body, self.prefill.response)
        if self.named is not None:
            self.early_call = first_call(self.prefill.response, self.named)
            text = call_arguments(self.early_call)
        else:
            text = first_text(self.path, self.prefill.response)
        if allow_early and self._can_send_early(text):
            self.early = text
        else:
            self.first = await self._open_decoder()

    async def _prepare_streamed(
        self, allow_early: bool, answer: asyncio.Future[dict[str, Any] | None]
    ) -> None:
        """A streamed (layer-wise) leg: the decoder's stream opens with its first token, so
        the prefill's token goes early if the prefill's own answer comes first."""
        opening = asyncio.ensure_future(self._open_decoder())
        if allow_early:
            try:
                either: set[asyncio.Future[Any]] = {opening, answer}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                opening.cancel()
                raise
            response = answer.result() if answer.done() and not opening.done() else None
            if response is not None and self._can_send_early(first_text(self.path, response), response):
                self.prefill = dataclasses.replace(self._prefilled(), response=response)
                self.early, self.opening = first_text(self.path, response), opening
                return
        self.first = await opening

    def _prefilled(self) -> Prefilled:
        """The prefill's answer (`start` waited for it)."""
        if self.prefill is None:
            raise RuntimeError("the leg has not started: no prefill answer yet")
        return self.prefill

    def _can_send_early(self, text: str, response: dict[str, Any] | None = None) -> bool:
        """Whether ``text`` may go before the decoder's stream (``response``: the prefill's
        answer, if not the leg's)."""
        return (
            bool(text)
            and REPLACEMENT_CHAR not in text
            and decoder_repeats_first_token(self.body, response or self._prefilled().response)
            and not stop_may_cut(text, self.body.get("stop"))
        )

    async def _open_decoder(self) -> UpstreamStream:
        prefilled = self._prefilled()
        body = decode_body(self.body, prefilled.response)
        if self.can_fail_over:
            body["return_token_ids"] = True
        pool = prefilled.answering_pool(self.ctx)
        try:
            return await self._open(body, prefilled.route, pool, move_when_lost=not self.can_fail_over)
        except InstanceLostError as exc:
            return await self._start_over(exc)

    async def _start_over(self, exc: InstanceLostError) -> UpstreamStream:
        """The decoder died holding the leg's request, before answering. It may have read the
        prefill's KV, which the prefiller then frees: another decoder handed the same params
        could not load it. The whole answer on another decoder, which computes the prompt."""
        logger.warning("decoder lost before answering (%s); the whole answer on another decoder", exc)
        self.ctx.metrics.failover(streamed=True)
        release_abandoned(self.ctx, self._prefilled(), self.headers)
        body = decode_body(self.body, {})
        body["return_token_ids"] = True
        return await self._open(body, self._prefilled().route)

    async def _open(
        self,
        body: dict[str, Any],
        route: RouteKey | None = None,
        pool: InstancePool | None = None,
        move_when_lost: bool = True,
    ) -> UpstreamStream:
        """A stream from ``pool`` (default: the decoders, which continue lost answers); an
        instance lost holding the request is left for another unless ``move_when_lost`` is
        false (InstanceLostError)."""
        stream = await self.ctx.upstream.open_stream(
            pool or self.ctx.decode, self.path, body, self.headers, route=route, move_when_lost=move_when_lost
        )
        self.streams.append(stream)
        return stream

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """Chunks for the client; an ``{"error": ...}`` chunk ends the leg. A decoder lost
        mid-stream is replaced by other ones continuing the answers (see failover.py)."""
        if self.early is not None:
            self.ctx.metrics.early_first_token()
            prefill = self._prefilled().response
            for chunk in early_chunks(self.path, prefill, self.early, self.answers, self.early_call):
                yield self._with_prompt_logprobs(chunk)
            if self.path == CHAT:
                self.roles_sent.update(range(self.answers))
            self.pending = self.early
            self.first = await (self.opening or self._open_decoder())
        assert self.first is not None
        async for chunk in self._stream_chunks(self.first, list(range(self.answers))):
            yield chunk
        usage = self.sent.leg_usage(self.resumed_usage)
        if usage is not None and not self.usage_sent:
            yield {**chunk_meta(self.path, self._prefilled().response), "choices": [], "usage": usage}
        if self.pending:
            logger.warning("decoder's answer is shorter than the prefill's first token %r", self.early)

    async def _stream_chunks(
        self, stream: UpstreamStream, choices: list[int]
    ) -> AsyncIterator[dict[str, Any]]:
        """The client's chunks of one decoder stream, whose answer i is the leg's choice
        ``choices[i]``; a stream lost midway is continued, per unfinished choice, on others."""
        try:
            async for chunk in self._decoder_chunks(stream, choices):
                yield chunk
            return
        except DECODER_LOST as exc:
            if not self.can_fail_over:
                raise
            await self._drop_lost(stream, exc)
        unfinished = self.sent.unfinished(choices)
        opened = await gather_or_cancel([self._open(self.sent.resume_body(self.body, i)) for i in unfinished])
        sources = [(i, self._stream_chunks(s, [i])) for i, s in zip(unfinished, opened)]
        async with contextlib.aclosing(interleave(sources)) as items:
            async for _, chunk in items:
                yield chunk

    async def _decoder_chunks(
        self, stream: UpstreamStream, choices: list[int]
    ) -> AsyncIterator[dict[str, Any]]:
        async for obj in stream.events():
            if obj is SSE_DONE:
                return
            if isinstance(obj, dict) and "error" in obj:
                yield obj
                return
            for choice in obj.get("choices") or []:
                choice["index"] = choices[choice.get("index", 0)]
            if self.can_fail_over:
                self.sent.record(obj, self.client_wants_ids)
                if self._keep_resumed_usage(obj, choices):
                    continue
            chunk = self._strip_early(obj)
            if chunk is not None and not self._role_again(chunk):
                self.usage_sent = self.usage_sent or bool(chunk.get("usage"))
                yield self._with_prompt_logprobs(chunk)

    def _keep_resumed_usage(self, chunk: dict[str, Any], choices: list[int]) -> bool:
        """A continuation's usage chunk: corrected and kept for the leg's (sent at its end)."""
        if not self.failed_over or chunk.get("choices") or not isinstance(chunk.get("usage"), dict):
            return False
        [index] = choices  # a continuation carries one answer
        self.sent.choices[index].fix_usage(chunk)
        self.resumed_usage[index] = chunk["usage"]
        return True

    def _with_prompt_logprobs(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """The prefiller's prompt_logprobs in the first chunk of each choice (chat: at the top
        of the stream's first chunk), where a colocated server sends them."""
        if self.prompt_logprobs is None:
            return chunk
        if self.path == CHAT:
            if not self.prompt_logprobs_sent:
                self.prompt_logprobs_sent.add(0)
                return {**chunk, "prompt_logprobs": self.prompt_logprobs}
            return chunk
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            if index not in self.prompt_logprobs_sent:
                self.prompt_logprobs_sent.add(index)
                choice["prompt_logprobs"] = self.prompt_logprobs
        return chunk

    async def _drop_lost(self, lost: UpstreamStream, exc: Exception) -> None:
        """Drop a lost decoder's stream (its answers continue on others)."""
        logger.warning("decoder lost mid-stream (%s); continuing on another decoder", exc)
        self.failed_over = True
        lost.pool.mark(lost.instance, False, str(exc))
        await lost.aclose()
        if lost is self.first:  # the decoder handed the prefill's KV
            release_abandoned(self.ctx, self._prefilled(), self.headers)
        self.ctx.metrics.failover(streamed=True)

    def _role_again(self, chunk: dict[str, Any]) -> bool:
        """Whether ``chunk`` is a chat role chunk the client already got (from the prefill's
        early text, or from a decoder lost since)."""
        if self.path != CHAT or not is_role_chunk(chunk):
            return False
        indices = {choice.get("index", 0) for choice in chunk["choices"]}
        again = indices <= self.roles_sent
        self.roles_sent |= indices
        return again

    def _strip_early(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        if self.early is None:
            return chunk
        stripped, self.pending = strip_sent(self.path, chunk, self.pending)
        return stripped

    async def aclose(self) -> None:
        """Drop the decoder streams; with none opened, release the prefill's kept KV (no
        await before that: the caller may be in a cancelled scope)."""
        if self.opening is not None and not self.opening.done():
            self.opening.cancel()  # its request is aborted with the connection
        if not self.streams:
            if self.prefill is not None:
                release_abandoned(self.ctx, self.prefill, self.headers)
            return
        for stream in self.streams:
            await stream.aclose()


def early_chunks(
    path: str, prefill: dict[str, Any], text: str, answers: int = 1, call: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The chunks sent before the decoder's stream: choice 0's first ``text`` (chat: after
    the role chunk of each of the ``answers`` choices, as a colocated server opens it; a
    named function's ``call``: that text as the call's first ``tool_calls`` entry)."""
    meta = chunk_meta(path, prefill)
    if path == CHAT:
        delta = {"tool_calls": [call]} if call is not None else {"content": text}
        first = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return [_role_chunk(meta, index) for index in range(answers)] + [{**meta, "choices": [first]}]
    return [{**meta, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}]


def chunk_meta(path: str, prefill: dict[str, Any]) -> dict[str, Any]:
    """A chunk's fields besides its choices (the proxy sets the id)."""
    created = prefill.get("created", int(time.time()))
    kind = "chat.completion.chunk" if path == CHAT else "text_completion"
    return {"id": None, "object": kind, "created": created, "model": prefill.get("model")}


def _role_chunk(meta: dict[str, Any], index: int) -> dict[str, Any]:
    chunk = chat_role_chunk(meta)
    chunk["choices"][0]["index"] = index
    return chunk


def strip_sent(path: str, chunk: dict[str, Any], pending: str) -> tuple[dict[str, Any] | None, str]:
    """Drop from a decoder chunk what the client already got early: choice 0's ``pending``
    text and, for chat, every choice's role (token ids stay: the early text carried none).
    Returns the chunk (None when nothing is left) and what is still pending."""
    choices = []
    for choice in chunk.get("choices") or []:
        choice = dict(choice)
        if choice.get("index", 0) == 0:
            left, pending = _strip_text(path, choice, pending, first=True)
        else:
            left, _ = _strip_text(path, choice, "", first=False)
        if left or choice.get("finish_reason") is not None or _carries_more(choice):
            choices.append(choice)
    if not choices and not chunk.get("usage"):
        return None, pending
    return {**chunk, "choices": choices}, pending


def _strip_text(path: str, choice: dict[str, Any], pending: str, first: bool) -> tuple[bool, str]:
    """Drop ``pending`` from the start of ``choice``'s text (in place; chat: its role too,
    and for the ``first`` choice a named call's announcement, early_calls.py); returns
    whether text or calls are left, and what is still pending."""
    if path == CHAT:
        delta = {k: v for k, v in (choice.get("delta") or {}).items() if k != "role"}
        text = delta.pop("content", None) or ""
        text, pending = skip_sent(text, pending) if text and pending else (text, pending)
        calls = delta.pop("tool_calls", None) or []
        if first:
            calls, pending = strip_calls(calls, pending)
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        choice["delta"] = delta
        return bool(text or calls), pending
    text = choice.get("text") or ""
    text, pending = skip_sent(text, pending) if text and pending else (text, pending)
    choice["text"] = text
    return bool(text), pending


def _carries_more(choice: dict[str, Any]) -> bool:
    """Whether a choice carries more than text: logprobs, or token ids the client asked for
    (the early text went without them)."""
    return any(choice.get(name) is not None for name in ("logprobs", "token_ids", "prompt_token_ids"))


def _has_text(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def open_stream(
    ctx: ProxyContext, path: str, body: dict[str, Any], headers: dict[str, str], start: float
) -> AsyncIterator[str]:
    """Run the prefills (errors raise here, before any response); the SSE lines to send."""
    legs = [StreamLeg(ctx, path, i, leg, headers) for i, leg in enumerate(split_legs(path, body))]
    allow_early = ctx.early_first_token and not wants_logprobs(path, body) and ctx.decode.num_healthy > 0
    allow_early = allow_early and early_with_tools(body)  # see early_calls.py
    try:
        await gather_or_cancel([leg.prepare(allow_early) for leg in legs])
    except BaseException:
        await _close(legs)
        raise
    return _events(ctx, path, legs, start)


async def _events(ctx: ProxyContext, path: str, legs: list[StreamLeg], start: float) -> AsyncIterator[str]:
    prefix = "chatcmpl" if path == CHAT else "cmpl"
    stream_id = f"{prefix}-{uuid.uuid4().hex}"
    usages: list[dict[str, Any]] = []
    first = True
    try:
        async with contextlib.aclosing(interleave([(leg, leg.chunks()) for leg in legs])) as items:
            async for leg, chunk in items:
                if "error" in chunk:
                    yield sse(chunk)
                    break
                chunk["id"] = stream_id
                if not chunk.get("choices") and chunk.get("usage"):
                    usages.append(chunk)
                    continue
                for choice in chunk["choices"]:
                    choice["index"] = choice_index(leg.index, leg.answers, choice.get("index", 0))
                if first and _has_text(chunk):
                    first = False
                    ctx.metrics.first_chunk(time.monotonic() - start)
                yield sse(chunk)
            else:
                if usages:
                    yield sse({**usages[-1], "usage": sum_usage([u["usage"] for u in usages])})
    except Exception as exc:  # an instance failed after the response started: tell the client in-stream
        logger.warning("stream %s failed: %s", stream_id, exc)
        yield sse(exception_event_body(exc))
    finally:
        await _close(legs)
    yield SSE_DONE_EVENT


async def _close(legs: list[StreamLeg]) -> None:
    for leg in legs:
        try:
            await leg.aclose()
        except Exception:
            logger.exception("closing an upstream stream failed")
