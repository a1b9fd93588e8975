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


def _case(layout: Layout, dtype: torch.dtype, window: int, stored_dim: int, seed: int = 0):
    """A random cache of 3 KV heads, 9 query heads of 32 values (stored `stored_dim` wide),
    and one decode per SEQ_LENS entry on shuffled blocks; sliding-window tables start at
    the first block the window sees, as the scheduler sends them."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, kv_heads, dim = 40, 3, 32
    shape = (2, num_blocks, BLOCK, kv_heads, stored_dim)
    if layout is Layout.HND:
        shape = (2, num_blocks, kv_heads, BLOCK, stored_dim)
    cache = torch.randn(shape, generator=gen).to(dtype)
    lens = torch.tensor(SEQ_LENS)
    first = [max(0, n - window) // BLOCK if window else 0 for n in SEQ_LENS]
    width = max(-(-n // BLOCK) - f for n, f in zip(SEQ_LENS, first, strict=True))
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = ids[: len(SEQ_LENS) * width].view(len(SEQ_LENS), width)
    start = torch.tensor([f * BLOCK for f in first]) if window else None
    q = torch.randn(len(SEQ_LENS), 9, dim, generator=gen).to(dtype)
    attn = AttentionMetadata(torch.zeros(len(SEQ_LENS), dtype=torch.long), len(SEQ_LENS), table, lens)
    attn.decode_start_pos = start
    return q, cache, attn


@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("window", [0, 10, 20])
@pytest.mark.parametrize("stored_dim", [32, 48])  # 48: a group padded to a wider page
def test_the_kernel_equals_the_sdpa_path(layout, dtype, tolerance, window, stored_dim) -> None:
    assert decode_kernel.decode_kernel_available()
    q, cache, attn = _case(layout, dtype, window, stored_dim)
    ctx = ForwardContext((attn,), {"layer": 0}, {"layer": cache}, layout)
    score = Scores(0.17, window)
    expected = attention._decode_sdpa(q, cache, ctx, attn, score)
    got = decode_kernel.paged_decode(
        q, cache, layout, attn.decode_block_table, attn.decode_seq_lens, attn.decode_start_pos, window, 0.17
    )
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


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
