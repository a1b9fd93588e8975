"""http_common's helpers for several upstream streams: interleave and gather_or_cancel."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from kvferry.entrypoints.http_common import chat_role_chunk, gather_or_cancel, interleave, sse


async def _items(values: list, delay: float = 0.0, fail: bool = False) -> AsyncIterator:
    for v in values:
        await asyncio.sleep(delay)
        yield v
    if fail:
        raise ValueError("upstream failed")


def test_interleave_keys_every_item() -> None:
    async def go() -> list:
        return [kv async for kv in interleave([("a", _items([1, 2], 0.001)), ("b", _items([3]))])]

    got = asyncio.run(go())
    assert sorted(got) == [("a", 1), ("a", 2), ("b", 3)]
    assert [v for k, v in got if k == "a"] == [1, 2]  # each stream keeps its order


def test_interleave_raises_the_first_failure_and_stops_the_rest() -> None:
    endless_closed = asyncio.Event()

    async def endless() -> AsyncIterator[int]:
        try:
            while True:
                await asyncio.sleep(0.001)
                yield 0
        finally:
            endless_closed.set()

    async def go() -> None:
        with pytest.raises(ValueError, match="upstream failed"):
            async with contextlib.aclosing(
                interleave([(0, endless()), (1, _items([5], fail=True))])
            ) as items:
                async for _ in items:
                    pass
        await asyncio.wait_for(endless_closed.wait(), 1)  # its reading task was cancelled

    asyncio.run(go())


def test_gather_or_cancel_cancels_the_rest_on_failure() -> None:
    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def failing() -> None:
        raise KeyError("boom")

    async def go() -> None:
        assert await gather_or_cancel([asyncio.sleep(0, "x"), asyncio.sleep(0, "y")]) == ["x", "y"]
        with pytest.raises(KeyError):
            await gather_or_cancel([slow(), failing()])
        assert cancelled.is_set()

    asyncio.run(go())


def test_sse_and_the_chat_role_chunk() -> None:
    assert sse({"a": "é", "b": [1]}) == 'data: {"a":"é","b":[1]}\n\n'
    chunk = chat_role_chunk({"id": "x"})
    assert chunk["id"] == "x" and chunk["choices"][0]["delta"] == {"role": "assistant", "content": ""}
