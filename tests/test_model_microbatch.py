"""Micro-batch threads: batches cut at request boundaries give the whole batch's results."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvferry.model.forward_context import AttentionMetadata, ForwardContext, PrefillSpan
from kvferry.model.loader import load_model
from kvferry.model.microbatch import MicroBatcher
from kvferry.model.resolve import resolve_model_config
from tests.fixtures.paged import Chunk, PagedDriver


def _metadata(num_decodes: int, span_lens: list[int], block_size: int = 4) -> AttentionMetadata:
    lens = torch.arange(num_decodes) + 3
    table = torch.arange(num_decodes * 8).view(num_decodes, 8)
    spans, start = [], num_decodes
    for i, n in enumerate(span_lens):
        spans.append(PrefillSpan(start, n, i, torch.tensor([i])))
        start += n
    return AttentionMetadata(torch.arange(start), num_decodes, table, lens, spans, block_size)


def _ctx(attn: AttentionMetadata, hooks: object = None) -> ForwardContext:
    return ForwardContext((attn, attn), {}, {}, kv_hooks=hooks)


def test_split_batch_cuts_at_request_boundaries() -> None:
    attn = _metadata(10, [6, 20, 3])
    parts = MicroBatcher(2).split_batch(_ctx(attn), 39)
    assert [(p.start, p.stop) for p in parts] == [(0, 16), (16, 39)]  # the span at 16 starts part 2
    first, second = (p.ctx.attn[0] for p in parts)
    assert first.num_decodes == 10 and [s.query_start for s in first.prefills] == [10]
    assert torch.equal(first.slot_mapping, attn.slot_mapping[:16])
    assert first.decode_block_table.shape == (10, 3)  # longest: 12 tokens in blocks of 4
    assert second.num_decodes == 0 and [(s.query_start, s.query_len) for s in second.prefills] == [
        (0, 20),
        (20, 3),
    ]
    assert len(parts[1].ctx.attn) == 2


def test_a_batch_holding_a_recomputed_request_stays_whole() -> None:
    """A preempted request recomputed as decode rows and a prefill span (its generated rows
    read the KV its prompt rows write this step): never cut, whatever the boundaries."""
    attn = _metadata(10, [6, 20, 3])
    attn.split_requests = True
    assert [(p.start, p.stop) for p in MicroBatcher(2).split_batch(_ctx(attn), 39)] == [(0, 39)]


def test_decodes_split_evenly_and_small_batches_stay_whole() -> None:
    parts = MicroBatcher(2).split_batch(_ctx(_metadata(64, [])), 64)
    assert [(p.start, p.stop, p.ctx.attn[0].num_decodes) for p in parts] == [(0, 32, 32), (32, 64, 32)]
    assert len(MicroBatcher(2).split_batch(_ctx(_metadata(5, [])), 5)) == 1
    assert len(MicroBatcher(2).split_batch(_ctx(_metadata(0, [40])), 40)) == 1  # one request
    assert [(p.start, p.stop) for p in MicroBatcher(3).split_rows(13)] == [(0, 4), (4, 8), (8, 13)]
    assert [(p.start, p.stop) for p in MicroBatcher(3).split_rows(10)] == [(0, 5), (5, 10)]  # >= 4 rows each


def test_map_runs_in_order_on_several_threads() -> None:
    import threading

    mb = MicroBatcher(3)
    before = torch.get_num_threads()
    names = mb.map(
        lambda i: (i, threading.current_thread().name, torch.is_inference_mode_enabled()), [0, 1, 2]
    )
    assert [n[0] for n in names] == [0, 1, 2] and all(n[2] for n in names)
    assert "MainThread" in {n[1] for n in names} and len({n[1] for n in names}) >= 2
    assert torch.get_num_threads() == before  # the caller's thread count is back


@pytest.mark.parametrize("threads", [2, 3])
def test_model_results_match_the_whole_batch(tiny_llama: Path, threads: int) -> None:
    model = load_model(resolve_model_config(str(tiny_llama)))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 900, (n,), generator=gen).tolist() for n in (9, 9, 9, 14, 6, 9, 21)]
    chunks = [Chunk(str(i), p[:5]) for i, p in enumerate(prompts)]
    steps = [
        chunks,
        [
            Chunk(str(i), p[5:]) if i % 2 else Chunk(str(i), [p[5]], decode=True)
            for i, p in enumerate(prompts)
        ],
    ]
    steps.append([Chunk(str(i), [7], decode=True) for i in range(len(prompts))])
    splitter = MicroBatcher(threads)
    part_counts: list[int] = []
    map_parts = splitter.map
    splitter.map = lambda fn, items: part_counts.append(len(items)) or map_parts(fn, items)
    results = []
    for microbatcher in (None, splitter):
        model.microbatcher = microbatcher
        driver = PagedDriver(model, num_blocks=64, block_size=4, seed=1)
        results.append([driver.step(step) for step in steps])
    for whole, split in zip(*results, strict=True):
        for req, logits in whole.items():
            torch.testing.assert_close(split[req], logits, atol=1e-5, rtol=0)
    assert max(part_counts) >= 2  # the batches really were split
