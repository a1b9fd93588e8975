"""Micro-batch threads: one forward's batch split over CPU threads, one intra-op thread each.

torch parallelizes each op over OpenMP threads, with a barrier at the end of every op:
~20 per layer. On a CPU shared with other processes a barrier waits until every thread
has been scheduled again, and a 2-thread decode step then ran 2-10x *slower* than one
thread (measured on a loaded 2-core EPYC). Here the batch is cut at request boundaries
into one part per thread; each part is a whole forward on one core, and the threads meet
once, at the end. Rows are computed exactly as in the full batch (the same kernels on
the same rows), so the results are identical.

Only for one process on its own (no tensor parallelism: collectives must be issued in
one order) and without per-layer connector hooks (they are called once per layer; a
connector without them, like the NIXL one of a P/D decoder, does not stop it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from kvferry.model.forward_context import AttentionMetadata, ForwardContext

MIN_TOKENS_PER_PART = 4  # fewer rows per thread: not worth a thread hand-off
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Part:
    """Tokens [start, stop) of the flat batch and their own forward context."""

    start: int
    stop: int
    ctx: ForwardContext | None = None


@contextmanager
def intra_op_threads(num: int) -> Iterator[None]:
    """torch's intra-op threads for the calling thread, restored on exit."""
    before = torch.get_num_threads()
    if before == num:
        yield
        return
    torch.set_num_threads(num)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class MicroBatcher:
    """Runs the parts of a batch on `num_threads` threads, the caller's among them."""

    def __init__(self, num_threads: int):
        assert num_threads > 1
        self.num_threads = num_threads
        self._pool: ThreadPoolExecutor | None = None

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self.num_threads - 1,
                thread_name_prefix="kvferry-microbatch",
                initializer=torch.set_num_threads,  # per thread: its OpenMP team is itself
                initargs=(1,),
            )
        return self._pool

    def map(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        """fn over items, concurrently; results in order. The first item runs here."""
        assert 0 < len(items) <= self.num_threads

        def run(item: T) -> R:
            with torch.inference_mode():  # thread-local, like grad mode
                return fn(item)

        futures = [self._threads().submit(run, item) for item in items[1:]]
        with intra_op_threads(1):
            first = run(items[0])
        return [first, *(future.result() for future in futures)]

    def split_rows(self, num_rows: int) -> list[Part]:
        """Contiguous, nearly equal row ranges (rows independent of each other)."""
        parts = min(self.num_threads, num_rows // MIN_TOKENS_PER_PART)
        bounds = [num_rows * i // max(parts, 1) for i in range(parts + 1)]
        return [Part(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]

    def split_batch(self, ctx: ForwardContext, num_tokens: int) -> list[Part]:
        """Parts cut at request boundaries, each with its own attention metadata; one part
        (the whole batch) when it cannot or should not be split."""
        whole = [Part(0, num_tokens, ctx)]
        if num_tokens < 2 * MIN_TOKENS_PER_PART or any(group.split_requests for group in ctx.attn):
            return whole
        cuts = _cuts(ctx.attn[0], num_tokens, self.num_threads)
        if len(cuts) < 3:
            return whole
        return [Part(a, b, _sub_context(ctx, a, b)) for a, b in zip(cuts, cuts[1:])]


def _boundaries(attn: AttentionMetadata, num_tokens: int) -> list[int]:
    """Token indices where a request starts (and the end): where a batch may be cut."""
    decodes = attn.decode_request_starts
    starts = list(range(attn.num_decodes) if decodes is None else decodes)
    starts += [span.query_start for span in attn.prefills]
    return [*starts, num_tokens]


def _cuts(attn: AttentionMetadata, num_tokens: int, parts: int) -> list[int]:
    """0, the boundaries nearest to equal shares of the tokens, num_tokens (no empty part)."""
    bounds = _boundaries(attn, num_tokens)
    cuts = [0]
    for i in range(1, parts):
        target = num_tokens * i / parts
        best = min(bounds, key=lambda b: abs(b - target))
        if cuts[-1] + MIN_TOKENS_PER_PART <= best <= num_tokens - MIN_TOKENS_PER_PART:
            cuts.append(best)
    cuts.append(num_tokens)
    return cuts


def _sub_context(ctx: ForwardContext, start: int, stop: int) -> ForwardContext:
    attn = tuple(_sub_metadata(group, start, stop) for group in ctx.attn)
    return ForwardContext(attn, ctx.layer_group, ctx.kv_caches, ctx.layout, None, ctx.workspace)


def _sub_metadata(attn: AttentionMetadata, start: int, stop: int) -> AttentionMetadata:
    """The metadata of tokens [start, stop): its decodes, its spans (re-based)."""
    lo, hi = min(start, attn.num_decodes), min(stop, attn.num_decodes)
    seq_lens = attn.decode_seq_lens[lo:hi]
    table = attn.decode_block_table[lo:hi]
    if hi > lo:  # only the blocks this part's longest sequence needs (less to gather; with
        # decode_start_pos, tables start later: this keeps more columns than needed, masked)
        table = table[:, : -(-int(seq_lens.max()) // attn.block_size)]
    spans = [
        replace(span, query_start=span.query_start - start)
        for span in attn.prefills
        if start <= span.query_start < stop
    ]
    return AttentionMetadata(
        slot_mapping=attn.slot_mapping[start:stop],
        num_decodes=hi - lo,
        decode_block_table=table,
        decode_seq_lens=seq_lens,
        prefills=spans,
        block_size=attn.block_size,
        decode_start_pos=None if attn.decode_start_pos is None else attn.decode_start_pos[lo:hi],
        decode_request_starts=_rebased_starts(attn.decode_request_starts, lo, hi),
    )


def _rebased_starts(starts: tuple[int, ...] | None, lo: int, hi: int) -> tuple[int, ...] | None:
    """A part's first decode rows per request (its parts are cut at request starts)."""
    return None if starts is None else tuple(s - lo for s in starts if lo <= s < hi)
