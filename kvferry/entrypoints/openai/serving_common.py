"""Shared pieces of the completion and chat handlers: state, SSE, usage, disconnects, batches."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvferry.engine.async_engine import AsyncEngine
from kvferry.entrypoints.http_common import ClientDisconnected
from kvferry.entrypoints.openai.errors import exception_body
from kvferry.errors import ModelNotFoundError
from kvferry.outputs import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request": nobody reads it


@dataclass(frozen=True)
class ServerState:
    engine: AsyncEngine
    served_model_name: str

    def check_model(self, requested: str | None) -> str:
        """The model name to report; unknown names are 404 as in OpenAI's API."""
        if requested is not None and requested != self.served_model_name:
            raise ModelNotFoundError(f"The model `{requested}` does not exist.", param="model")
        return self.served_model_name


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


def sse_error(exc: BaseException) -> str:
    _, body = exception_body(exc)
    return sse(body)


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def final_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Drain a generate() stream and return its last output."""
    last = None
    async for out in gen:
        last = out
    if last is None:
        raise ClientDisconnected()  # aborted before any output
    return last


async def first_outputs(gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The first output of every stream, concurrently; all are closed if any fails.

    Streams submit their request on the first ``anext``, so this is where a bad prompt
    raises: before a streaming response commits to HTTP 200.
    """
    return await _all_or_none(gens, [anext(g) for g in gens])


async def final_outputs(gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The last output of every stream, concurrently; all are closed if any fails."""
    return await _all_or_none(gens, [final_output(g) for g in gens])


async def _all_or_none(gens: list[AsyncIterator[RequestOutput]], work: list[Awaitable[T]]) -> list[T]:
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(gens)
        raise


async def close_all(gens: list[AsyncIterator[RequestOutput]]) -> None:
    for g in gens:
        try:
            await g.aclose()  # type: ignore[attr-defined]
        except Exception:
            logger.exception("closing a generate() stream failed")


async def merge(
    firsts: list[RequestOutput], gens: list[AsyncIterator[RequestOutput]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams (a batch of prompts) as (index, output)."""
    try:
        for i, first in enumerate(firsts):
            yield i, first
        if len(gens) == 1:
            if not firsts[0].finished:
                async for out in gens[0]:
                    yield 0, out
        else:
            async for item in _interleave(firsts, gens):
                yield item
    finally:
        await close_all(gens)


async def _interleave(
    firsts: list[RequestOutput], gens: list[AsyncIterator[RequestOutput]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except Exception as exc:
            await queue.put((i, exc))
        await queue.put((i, None))

    live = [i for i, first in enumerate(firsts) if not first.finished]
    tasks = [asyncio.ensure_future(pump(i, gens[i])) for i in live]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])
