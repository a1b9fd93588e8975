"""n > 1 and best_of: one engine request per answer ("child"), sharing the prompt's KV.

A prompt's first child is submitted alone; its siblings once it has produced its first
token, i.e. once its prompt's KV is computed and its full blocks are in the prefix cache.
The siblings then hit the cache for every full block of the prompt and compute only the
tail (at least the last prompt token, whose logits they sample). Submitted together, each
would compute the whole prompt. Without prefix caching they recompute it (still correct).

Child i's seed is the request's seed + i (as vLLM), so seeded children differ and a seeded
request is reproducible. With best_of > n, the n children of highest cumulative logprob
(of the raw logprobs of their tokens) are returned, best first; the children are asked for
logprobs for that ranking even when the request is not.

Through P/D only the first child carries ``kv_transfer_params``: the prompt's KV crosses
once, and its siblings on the decoder hit the received blocks in the decoder's prefix cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

from kvferry.outputs import CompletionOutput, RequestOutput
from kvferry.sampling_params import SamplingParams, child_seed

logger = logging.getLogger(__name__)


def num_children(params: SamplingParams) -> int:
    return params.best_of or params.n


def ranks_children(params: SamplingParams) -> bool:
    """Whether the answers are chosen among more children (best_of > n)."""
    return num_children(params) > params.n


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of one child: one answer, its own seed, logprobs when ranked."""
    if num_children(params) == 1:
        return params
    seed = None if params.seed is None else child_seed(params.seed, index)
    logprobs = params.logprobs if params.logprobs is not None or not ranks_children(params) else 0
    return dataclasses.replace(params, n=1, best_of=None, seed=seed, logprobs=logprobs)


def cumulative_logprob(output: CompletionOutput) -> float:
    return sum(lp.sampled for lp in output.logprobs or [])


def best_children(children: list[RequestOutput], params: SamplingParams) -> list[RequestOutput]:
    """The n answers returned of one prompt's children: all of them, or (best_of > n) the n
    of highest cumulative logprob, best first (ties: the earlier child)."""
    if not ranks_children(params):
        return children
    order = sorted(range(len(children)), key=lambda i: -cumulative_logprob(children[i].outputs[0]))
    return [children[i] for i in order[: params.n]]


def merge_children(children: list[RequestOutput], params: SamplingParams) -> RequestOutput:
    """One prompt's answers as one output (the offline API's shape): the first child's, with
    the chosen answers as its outputs, indexed in order."""
    if len(children) == 1:
        return children[0]
    outputs = []
    for index, child in enumerate(best_children(children, params)):
        comp = dataclasses.replace(child.outputs[0], index=index)
        if params.logprobs is None:
            comp.logprobs = None  # asked for the ranking only
        outputs.append(comp)
    return dataclasses.replace(children[0], outputs=outputs)


OpenStream = Callable[[int], AsyncIterator[RequestOutput]]  # child index -> its generate()


def child_streams(params: SamplingParams, open_child: OpenStream) -> list[AsyncIterator[RequestOutput]]:
    """One stream per child; every child after the first starts once the first has an output."""
    count = num_children(params)
    if count == 1:
        return [open_child(0)]
    prefilled = asyncio.Event()
    return [_first_child(open_child(0), prefilled)] + [
        _sibling(open_child, i, prefilled) for i in range(1, count)
    ]


async def _first_child(
    stream: AsyncIterator[RequestOutput], prefilled: asyncio.Event
) -> AsyncIterator[RequestOutput]:
    try:
        async for out in stream:
            prefilled.set()
            yield out
    finally:
        prefilled.set()
        await stream.aclose()  # type: ignore[attr-defined]


async def _sibling(
    open_child: OpenStream, index: int, prefilled: asyncio.Event
) -> AsyncIterator[RequestOutput]:
    await prefilled.wait()
    stream = open_child(index)
    try:
        async for out in stream:
            yield out
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
