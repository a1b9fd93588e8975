"""The CPU paged decode kernel (kvferry/model/layers/decode_kernel.py): equal to the SDPA
path it replaces on every cache geometry, taken by a real engine, and a clean fallback
where it cannot be built."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvferry.engine.llm import LLM
from kvferry.kv.spec import Layout
from kvferry.model.forward_context import AttentionMetadata, ForwardContext
from kvferry.model.layers import attention, decode_kernel
from kvferry.model.layers.attention import Scores
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS

BLOCK = 16
SEQ_LENS = [1, 15, 16, 17, 40, 64]  # one key; block boundaries; several blocks


def _case(
    layout: Layout,
    dtype: torch.dtype,
    window: int,
    stored_dim: int,
    seed: int = 0,
    seq_lens: list[int] = SEQ_LENS,
    kv_heads: int = 3,
    heads: int = 9,
    dim: int = 32,
):
    """A random cache of `kv_heads` KV heads, `heads` query heads of `dim` values (stored
    `stored_dim` wide), and one decode per `seq_lens` entry on shuffled blocks;
    sliding-window tables start at the first block the window sees, as the scheduler sends
    them."""
    gen = torch.Generator().manual_seed(seed)
    first = [max(0, n - window) // BLOCK if window else 0 for n in seq_lens]
    width = max(-(-n // BLOCK) - f for n, f in zip(seq_lens, first, strict=True))
    num_blocks = max(40, len(seq_lens) * width + 1)
    shape = (2, num_blocks, BLOCK, kv_heads, stored_dim)
    if layout is Layout.HND:
        shape = (2, num_blocks, kv_heads, BLOCK, stored_dim)
    cache = torch.randn(shape, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens)
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = ids[: len(seq_lens) * width].view(len(seq_lens), width)
    start = torch.tensor([f * BLOCK for f in first]) if window else None
    q = torch.randn(len(seq_lens), heads, dim, generator=gen).to(dtype)
    attn = AttentionMetadata(torch.zeros(len(seq_lens), dtype=torch.long), len(seq_lens), table, lens)
    attn.decode_start_pos = start
    return q, cache, attn


def _assert_kernel_equals_sdpa(q, cache, attn, layout, window, tolerance, scale=0.17) -> None:
    ctx = ForwardContext((attn,), {"layer": 0}, {"layer": cache}, layout)
    expected = attention._decode_sdpa(q, cache, ctx, attn, Scores(scale, window))
    got = decode_kernel.paged_decode(
        q, cache, layout, attn.decode_block_table, attn.decode_seq_lens, attn.decode_start_pos, window, scale
    )
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.fixture
def threads(request: pytest.FixtureRequest):
    """torch's intra-op thread count for the test (the kernel plans its work by it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("window", [0, 10, 20])
@pytest.mark.parametrize("stored_dim", [32, 48])  # 48: a group padded to a wider page
def test_the_kernel_equals_the_sdpa_path(layout, dtype, tolerance, window, stored_dim) -> None:
    assert decode_kernel.decode_kernel_available()
    q, cache, attn = _case(layout, dtype, window, stored_dim)
    _assert_kernel_equals_sdpa(q, cache, attn, layout, window, tolerance)


# The kernel's work plan (csrc/paged_decode.cpp): every sequence's keys in spans of 256
# (the last shorter) whose partial softmaxes are merged, whatever the batch and threads;
# a sequence of one span is one item covering all its KV heads with 1 thread or 16
# sequences or more per thread, else one item per KV head.
LONG = [1100]  # one long decode: its keys in 5 spans, 3 KV heads on 2 threads
MIXED = [1, 130, 300, 1029]  # short ones unsplit, long ones split unevenly (tiles of 64 and a tail)


@pytest.mark.parametrize("threads", [2, 1], indirect=True)
@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize(("seq_lens", "window"), [(LONG, 0), (MIXED, 0), (LONG, 700), (MIXED, 333)])
def test_long_sequences_split_across_threads(threads, layout, dtype, tolerance, seq_lens, window) -> None:
    """Long contexts, also with windows whose tables start mid-sequence: the split spans'
    merge equals one softmax over all the keys."""
    assert decode_kernel.decode_kernel_available()
    q, cache, attn = _case(layout, dtype, window, 48, seq_lens=seq_lens)
    _assert_kernel_equals_sdpa(q, cache, attn, layout, window, tolerance)


@pytest.mark.parametrize("threads", [2, 1], indirect=True)
@pytest.mark.parametrize(
    ("kv_heads", "heads", "dim"),
    [
        (1, 12, 64),  # 1 (sequence, KV head) pair on 2 threads; a group of 12: passes of 8 and 4
        (2, 2, 40),  # no grouping; head_dim not a whole number of vectors
        (4, 28, 128),  # groups of 7, wide heads
    ],
)
def test_group_shapes_and_few_work_items(threads, kv_heads, heads, dim) -> None:
    assert decode_kernel.decode_kernel_available()
    q, cache, attn = _case(
        Layout.NHD, torch.float32, 0, dim, seq_lens=[700], kv_heads=kv_heads, heads=heads, dim=dim
    )
    _assert_kernel_equals_sdpa(q, cache, attn, Layout.NHD, 0, 2e-6)


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
@pytest.mark.parametrize("window", [0, 333])
def test_a_decode_gets_the_same_bits_alone_and_in_any_batch(threads, layout, window) -> None:
    """Batch invariance: a decode's output does not depend on the decodes beside it nor on
    the threads (the work plan once split long sequences by the batch's size: a long decode
    alone got other bits than in a batch of 40)."""
    lens = [1100, 257, 300, 40] + [(37 * i) % 900 + 1 for i in range(36)]
    q, cache, attn = _case(layout, torch.float32, window, 32, seq_lens=lens)
    scale = 0.17

    def decode(rows: list[int]) -> torch.Tensor:
        table, seq_lens = attn.decode_block_table[rows], attn.decode_seq_lens[rows]
        start = None if attn.decode_start_pos is None else attn.decode_start_pos[rows]
        return decode_kernel.paged_decode(q[rows], cache, layout, table, seq_lens, start, window, scale)

    batch = decode(list(range(len(lens))))
    for row in range(4):
        assert torch.equal(decode([row]), batch[row : row + 1])
        assert torch.equal(decode([row, 5, 6]), batch[[row, 5, 6]])
    torch.set_num_threads(1)
    assert torch.equal(decode(list(range(len(lens)))), batch)


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_a_large_batch_takes_one_item_per_sequence(threads) -> None:
    """16 or more decodes per thread: each sequence's KV heads in one item, fp16 too."""
    assert decode_kernel.decode_kernel_available()
    lens = [(37 * i) % 500 + 1 for i in range(40)]
    for dtype, tolerance in ((torch.float32, 2e-6), (torch.float16, 2e-3)):
        q, cache, attn = _case(Layout.HND, dtype, 0, 32, seq_lens=lens)
        _assert_kernel_equals_sdpa(q, cache, attn, Layout.HND, 0, tolerance)


def _greedy(model: Path) -> list[list[int]]:
    llm = LLM(str(model), enforce_eager=True, kv_cache_bytes=16 << 20)
    try:
        outs = llm.generate(PROMPT_TEXTS[:4], SamplingParams(max_tokens=12, temperature=0))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()


def test_an_engine_decodes_through_the_kernel(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the SDPA decode path broken, an engine still answers: its decodes take the kernel."""
    expected = _greedy(tiny_llama)

    def broken(*args: object) -> torch.Tensor:
        raise AssertionError("decode took the SDPA path")

    monkeypatch.setattr(attention, "_decode_sdpa", broken)
    assert _greedy(tiny_llama) == expected


def test_without_a_compiler_decode_falls_back_to_sdpa_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached build either
    decode_kernel.decode_kernel_available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=decode_kernel.__name__):
            assert not decode_kernel.decode_kernel_available()
            assert not decode_kernel.decode_kernel_available()  # decided once
        (record,) = caplog.records
        assert "decode attention uses torch SDPA" in record.message and "/nonexistent/g++" in record.message
    finally:
        decode_kernel.decode_kernel_available.cache_clear()


def _written_by_hand(cache: torch.Tensor, layout: Layout, k, v, slots) -> torch.Tensor:
    """The reference: each token's heads assigned one by one (zero-padded to the stored width)."""
    out = cache.clone()
    dim = k.shape[-1]
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BLOCK)
        for h in range(k.shape[1]):
            at = (block, offset, h) if layout is Layout.NHD else (block, h, offset)
            out[0][at] = torch.nn.functional.pad(k[t, h], (0, out.shape[-1] - dim)).to(out.dtype)
            out[1][at] = torch.nn.functional.pad(v[t, h], (0, out.shape[-1] - dim)).to(out.dtype)
    return out


@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
@pytest.mark.parametrize(
    ("dtype", "stored_dim"), [(torch.float32, 32), (torch.bfloat16, 32), (torch.float32, 48)]
)
def test_the_kv_write_stores_every_head_at_its_slot(
    layout: Layout, dtype: torch.dtype, stored_dim: int
) -> None:
    """k and v as a step's qkv output holds them (strided rows) land where the reference
    puts them; a wider stored head takes the padded path, with the same result."""
    _, cache, _ = _case(layout, dtype, 0, stored_dim)
    qkv = torch.randn(5, (9 + 3 + 3) * 32).to(dtype)
    k = qkv[:, 9 * 32 : 12 * 32].view(5, 3, 32)  # rows 480 values apart
    v = qkv[:, 12 * 32 :].view(5, 3, 32)
    slots = torch.tensor([0, 17, 18, 5 * BLOCK + 15, 39 * BLOCK])
    expected = _written_by_hand(cache, layout, k, v, slots)
    attention.write_kv(cache, layout, k, v, slots)
    assert torch.equal(cache, expected)


def test_the_kernel_write_is_the_one_taken_and_refuses_a_slot_outside_the_cache() -> None:
    _, cache, _ = _case(Layout.NHD, torch.float32, 0, 32)
    k = v = torch.ones(1, 3, 32)
    assert decode_kernel.decode_kernel_available()
    with pytest.raises(RuntimeError, match="outside the cache"):
        attention.write_kv(cache, Layout.NHD, k, v, torch.tensor([cache.shape[1] * BLOCK]))
    with pytest.raises(RuntimeError, match="outside the cache"):
        decode_kernel.write_kv_slots(cache, Layout.NHD, k, v, torch.tensor([-1]))
