"""The CPU prefill attention kernel (kvferry/model/layers/prefill_kernel.py): equal to the
SDPA path it replaces for fresh prompts and for chunks over cached context on every cache
geometry, with and without a sliding window; taken by a real engine; a clean fallback
where it cannot be built."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvferry.engine.llm import LLM
from kvferry.kv.spec import Layout
from kvferry.model.forward_context import AttentionMetadata, ForwardContext, PrefillSpan
from kvferry.model.layers import attention, prefill_kernel
from kvferry.model.layers.attention import Scores
from kvferry.sampling_params import SamplingParams
from tests.avx2_build import outputs_of_the_avx2_build
from tests.engine_helpers import PROMPT_TEXTS
from tests.fixtures.tiny_models import build_tiny_model
from tests.tiers import SLOW, first_fast

BLOCK = 16
SCALE = 0.125
# fp32 (the AVX-512 or AVX2 microkernel at these head widths, where built): as exact as
# SDPA's own rounding; bf16 (the AVX-512 BF16 path where the CPU has it): probabilities are
# rounded to bf16 before the weighted sum, as in torch's bf16 flash kernel, and the outputs
# of both are bf16.
TOLERANCES = [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)]


# The fast tier runs every geometry on one thread; make test-all on two as well (356 tests).
@pytest.fixture(params=[1, pytest.param(2, marks=SLOW)], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """The kernel, built and loaded, run on 1 or 2 threads."""
    assert prefill_kernel.prefill_kernel_available()
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _qkv(length: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, gen: torch.Generator):
    q = torch.randn(length, heads, dim, generator=gen).to(dtype)
    k = torch.randn(length, kv_heads, dim, generator=gen).to(dtype)
    return q, k, torch.randn(length, kv_heads, dim, generator=gen).to(dtype)


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize("length", [1, 7, 32, 33, 100, 257])  # tiles are 32 queries and 32 keys
@pytest.mark.parametrize("window", [0, 5, 40, 300])  # 300: wider than every span
@pytest.mark.parametrize("group", [1, 3])
def test_a_fresh_span_equals_sdpa(dtype, tolerance, length, window, group, threads) -> None:
    gen = torch.Generator().manual_seed(length * 7 + window)
    q, k, v = _qkv(length, 3 * group, 3, 64, dtype, gen)
    score = Scores(SCALE, window)
    expected = attention._fresh_batch_sdpa(q, k, v, 1, score)
    got = prefill_kernel.fresh_prefill(q, k, v, 1, window, SCALE)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize("window", [0, 20])
def test_a_batch_of_fresh_spans_equals_sdpa(dtype, tolerance, window, threads) -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v = _qkv(3 * 45, 6, 2, 32, dtype, gen)
    score = Scores(SCALE, window)
    expected = attention._fresh_batch_sdpa(q, k, v, 3, score)
    got = prefill_kernel.fresh_prefill(q, k, v, 3, window, SCALE)
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("length", [33, 257])
@pytest.mark.parametrize("window", [0, 40])
def test_the_portable_fp32_tiles_equal_sdpa(length, window) -> None:
    """The tiles a CPU without AVX2 (or a head width off the multiples of 32) runs."""
    assert prefill_kernel.prefill_kernel_available()
    gen = torch.Generator().manual_seed(length + window)
    q, k, v = _qkv(length, 9, 3, 64, torch.float32, gen)
    expected = attention._fresh_batch_sdpa(q, k, v, 1, Scores(SCALE, window))
    got = prefill_kernel.fresh_prefill(q, k, v, 1, window, SCALE, portable=True)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_of_one_qkv_projection_give_the_bits_of_contiguous_inputs(dtype) -> None:
    """q, k and v as the attention layer passes them (views into one [T, (9 + 3 + 3) * 64]
    projection, each with its own strides) are read in place: the same bits as copies."""
    assert prefill_kernel.prefill_kernel_available()
    qkv = torch.randn(70, 15 * 64, generator=torch.Generator().manual_seed(9)).to(dtype)
    q, k, v = (part.view(70, -1, 64) for part in qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1))
    assert not q.is_contiguous() and k.stride() == v.stride() != (3 * 64, 64, 1)
    got = prefill_kernel.fresh_prefill(q, k, v, 1, 0, SCALE)
    expected = prefill_kernel.fresh_prefill(q.contiguous(), k.contiguous(), v.contiguous(), 1, 0, SCALE)
    assert got.is_contiguous() and torch.equal(got, expected)
    separate = prefill_kernel.fresh_prefill(q, k, v.contiguous(), 1, 0, SCALE)  # k, v strides differ
    assert torch.equal(separate, expected)


def _cached_span(layout: Layout, dtype: torch.dtype, stored_dim: int, context: int, length: int, group: int):
    """A span of `length` queries after `context` cached tokens on shuffled blocks of a
    random cache (3 KV heads of 32 values stored `stored_dim` wide); the span's own k/v
    are written into the cache as the layer does before attending."""
    gen = torch.Generator().manual_seed(context + length)
    num_blocks, kv_heads, dim = 64, 3, 32
    shape = (2, num_blocks, BLOCK, kv_heads, stored_dim)
    if layout is Layout.HND:
        shape = (2, num_blocks, kv_heads, BLOCK, stored_dim)
    cache = torch.randn(shape, generator=gen).to(dtype)
    blocks = -(-(context + length) // BLOCK)
    table = torch.randperm(num_blocks - 1, generator=gen)[:blocks] + 1
    q, k, v = _qkv(length, kv_heads * group, kv_heads, dim, dtype, gen)
    positions = torch.arange(context, context + length)
    slots = table[positions // BLOCK] * BLOCK + positions % BLOCK
    attention.write_kv(cache, layout, k, v, slots)
    attn = AttentionMetadata(slots, 0, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    ctx = ForwardContext((attn,), {"layer": 0}, {"layer": cache}, layout)
    return q, k, v, ctx, PrefillSpan(0, length, context, table)


@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
@pytest.mark.parametrize(("dtype", "tolerance"), TOLERANCES)
@pytest.mark.parametrize(("context", "length"), [(16, 1), (40, 33), (768, 64), (100, 7)])
@pytest.mark.parametrize("window", [0, 10, 50, 2000])
@pytest.mark.parametrize("stored_dim", [32, 48])  # 48: a group padded to a wider page
@pytest.mark.parametrize("group", [1, 3])
def test_a_span_over_cached_context_equals_sdpa(
    layout, dtype, tolerance, context, length, window, stored_dim, group, threads
) -> None:
    q, k, v, ctx, span = _cached_span(layout, dtype, stored_dim, context, length, group)
    cache, score = ctx.kv_caches["layer"], Scores(SCALE, window)
    expected = attention._prefill_sdpa(q, k, v, cache, ctx, span, score)
    start = attention._first_visible_block(context, window, BLOCK) * BLOCK
    got = prefill_kernel.paged_prefill(
        q, k, v, cache, layout, span.block_table, context, start, window, SCALE
    )
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
@pytest.mark.parametrize("kernel", ["microkernel", "portable"])
@pytest.mark.parametrize("window", [0, 50])
def test_a_row_gets_the_same_bits_alone_in_a_short_chunk_or_in_the_whole_prompt(
    layout, kernel, window, threads
) -> None:
    """A prompt's rows computed in one span, then again as the last rows over its cached
    context: the prompt's last token alone (what a P/D decoder or a full prefix-cache hit
    computes), a short chunk (one query tile: tiles packed as they are used) and a long one
    (every tile packed first, a partial last query tile). Identical bits every way."""
    length, dim, group = 300, 64, 3
    gen = torch.Generator().manual_seed(window + 1)
    q, k, v = _qkv(length, 3 * group, 3, dim, torch.float32, gen)
    portable = kernel == "portable"
    whole = prefill_kernel.fresh_prefill(q, k, v, 1, window, SCALE, portable=portable)
    num_blocks = -(-length // BLOCK) + 1
    shape = (2, num_blocks, BLOCK, 3, dim) if layout is Layout.NHD else (2, num_blocks, 3, BLOCK, dim)
    cache = torch.zeros(shape)
    table = torch.randperm(num_blocks, generator=gen)
    positions = torch.arange(length)
    attention.write_kv(cache, layout, k, v, table[positions // BLOCK] * BLOCK + positions % BLOCK)
    for context in (length - 1, length - 20, length - 77):
        start = attention._first_visible_block(context, window, BLOCK) * BLOCK
        rows = slice(context, length)
        chunk = prefill_kernel.paged_prefill(
            q[rows], k[rows], v[rows], cache, layout, table, context, start, window, SCALE, portable=portable
        )
        assert torch.equal(chunk, whole[rows]), f"rows from {context}"


def test_the_layer_takes_the_kernel_for_bf16() -> None:
    """bf16 of a 32-multiple head width on a CPU with AVX-512 BF16 goes to the kernel."""
    q, k, v, ctx, span = _cached_span(Layout.NHD, torch.bfloat16, 32, 40, 9, 3)
    assert prefill_kernel.prefill_kernel_available()
    if not prefill_kernel.fast_path(torch.bfloat16, 32):
        pytest.skip("this CPU has no AVX-512 BF16: bf16 prefill stays on SDPA")
    assert prefill_kernel.takes_prefill(q, k, v)
    got = attention._prefill(q, k, v, ctx.kv_caches["layer"], ctx, span, Scores(SCALE, 0))
    expected = attention._prefill_sdpa(q, k, v, ctx.kv_caches["layer"], ctx, span, Scores(SCALE, 0))
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def _needs_fp32_microkernel(head_dim: int) -> None:
    assert prefill_kernel.prefill_kernel_available()
    if not prefill_kernel.fast_path(torch.float32, head_dim):
        pytest.skip("this build has no fp32 microkernel (a CPU without AVX2 and FMA)")


def test_the_layer_takes_the_fp32_microkernel() -> None:
    """fp32 of a 32-multiple head width goes to the vector microkernel: the layer's output
    has its bits, not the portable tiles' (which sum in another order)."""
    _needs_fp32_microkernel(32)
    q, k, v, ctx, span = _cached_span(Layout.NHD, torch.float32, 32, 40, 45, 3)
    cache = ctx.kv_caches["layer"]
    assert prefill_kernel.takes_prefill(q, k, v)
    got = attention._prefill(q, k, v, cache, ctx, span, Scores(SCALE, 0))

    def kernel(portable: bool) -> torch.Tensor:
        return prefill_kernel.paged_prefill(
            q, k, v, cache, Layout.NHD, span.block_table, 40, 0, 0, SCALE, portable
        )

    assert torch.equal(got, kernel(portable=False))
    assert not torch.equal(got, kernel(portable=True))
    torch.testing.assert_close(got, kernel(portable=True), atol=2e-5, rtol=2e-5)


def _greedy(model: Path, **options: object) -> list[list[int]]:
    llm = LLM(str(model), enforce_eager=True, kv_cache_bytes=16 << 20, **options)
    try:
        outs = llm.generate(PROMPT_TEXTS, SamplingParams(max_tokens=8, temperature=0))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()


def _broken(*args: object) -> torch.Tensor:
    raise AssertionError("prefill took the SDPA path")


@pytest.mark.parametrize("chunk", first_fast([8, 2048]))  # 8 tokens a step: chunks over cached context
def test_an_engine_prefills_through_the_kernel(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, chunk
) -> None:
    """With the SDPA prefill paths broken, an engine still answers as the eager reference:
    its prefills take the kernel (here its portable fp32 tiles, as the tiny model's head
    width has no bf16 microkernel)."""
    expected = _greedy(tiny_llama, max_num_batched_tokens=chunk)
    monkeypatch.setattr(attention, "takes_prefill", lambda q, k, v: prefill_kernel.prefill_kernel_available())
    monkeypatch.setattr(attention, "_prefill_sdpa", _broken)
    monkeypatch.setattr(attention, "_fresh_batch_sdpa", _broken)
    assert _greedy(tiny_llama, max_num_batched_tokens=chunk) == expected


@pytest.fixture(scope="module")
def tiny_llama_head32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama_head32", tmp_path_factory.mktemp("tiny_llama_head32"))


NEAR_TIE = 0.1  # logprob gap under which bf16 rounding may pick either of two tokens


def _greedy_with_logprobs(model: Path, **options: object) -> list[tuple[list[int], list[list[float]]]]:
    """Per prompt: greedy tokens, and each step's two best logprobs."""
    llm = LLM(str(model), enforce_eager=True, kv_cache_bytes=16 << 20, **options)
    try:
        outs = llm.generate(PROMPT_TEXTS, SamplingParams(max_tokens=8, temperature=0, logprobs=2))
        return [
            (
                list(o.outputs[0].token_ids),
                [sorted((lp for _, lp in step.top), reverse=True) for step in o.outputs[0].logprobs or []],
            )
            for o in outs
        ]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("chunk", [2048, 8])
def test_a_bf16_engine_prefills_through_the_bf16_microkernels(
    tiny_llama_head32: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """End to end on the AVX-512 BF16 path: a bf16 engine (heads of 32) with the SDPA
    prefill paths broken answers as the same engine on SDPA does: the same greedy tokens,
    except from a step where SDPA's two best tokens are a near-tie (bf16 rounds them
    either way), and the same logprobs up to there."""
    assert prefill_kernel.prefill_kernel_available()
    if not prefill_kernel.fast_path(torch.bfloat16, 32):
        pytest.skip("this CPU has no AVX-512 BF16: bf16 prefill stays on SDPA")
    with monkeypatch.context() as on_sdpa:
        on_sdpa.setattr(attention, "takes_prefill", lambda q, k, v: False)
        expected = _greedy_with_logprobs(tiny_llama_head32, dtype="bfloat16", max_num_batched_tokens=chunk)
    monkeypatch.setattr(attention, "_prefill_sdpa", _broken)
    monkeypatch.setattr(attention, "_fresh_batch_sdpa", _broken)
    got = _greedy_with_logprobs(tiny_llama_head32, dtype="bfloat16", max_num_batched_tokens=chunk)
    for (tokens, tops), (ref_tokens, ref_tops) in zip(got, expected, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        if same < len(tokens):
            assert ref_tops[same][0] - ref_tops[same][1] < NEAR_TIE, (tokens, ref_tokens, ref_tops[same])
        for step in range(same):
            assert abs(tops[step][0] - ref_tops[step][0]) < NEAR_TIE, (step, tops[step], ref_tops[step])


@pytest.mark.parametrize("chunk", first_fast([2048, 8]))
def test_a_float32_engine_prefills_through_the_fp32_microkernel(
    tiny_llama_head32: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """End to end on the fp32 microkernel: a float32 engine (heads of 32) with the SDPA
    prefill paths broken gives the same greedy tokens as on SDPA, and logprobs within
    float32 rounding."""
    _needs_fp32_microkernel(32)
    with monkeypatch.context() as on_sdpa:
        on_sdpa.setattr(attention, "takes_prefill", lambda q, k, v: False)
        expected = _greedy_with_logprobs(tiny_llama_head32, max_num_batched_tokens=chunk)
    monkeypatch.setattr(attention, "_prefill_sdpa", _broken)
    monkeypatch.setattr(attention, "_fresh_batch_sdpa", _broken)
    got = _greedy_with_logprobs(tiny_llama_head32, max_num_batched_tokens=chunk)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, tops), (_, ref_tops) in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(tops), torch.tensor(ref_tops), atol=1e-4, rtol=0)


_AVX2_RUN = """
import sys, torch
torch.ops.load_library(sys.argv[1])
assert torch.ops.kvferry_cpu.prefill_fp32_lanes() == "avx2"
from kvferry.model.layers import prefill_kernel
cases = torch.load(sys.argv[2])
torch.save([prefill_kernel.fresh_prefill(q, k, v, count, window, scale) for q, k, v, count, window, scale in cases],
           sys.argv[3])
"""


@pytest.mark.slow  # builds the AVX2 library (~30 s)
def test_the_avx2_build_of_the_fp32_microkernel_equals_sdpa(tmp_path: Path) -> None:
    """The AVX2 lanes' microkernel (what an AVX2-only CPU runs; here built with AVX2 flags
    and loaded in a process of its own) against SDPA: lengths around the tiles, windows,
    grouped heads, a batch of spans, heads of 32 and 64."""
    gen = torch.Generator().manual_seed(3)
    cases = []
    for length, window, group, dim, count in [
        (1, 0, 1, 64, 1),
        (33, 0, 3, 64, 1),
        (257, 0, 3, 64, 1),
        (257, 40, 3, 64, 1),
        (100, 0, 2, 32, 3),
    ]:
        q, k, v = _qkv(length * count, 3 * group, 3, dim, torch.float32, gen)
        cases.append((q, k, v, count, window, SCALE))
    avx2 = outputs_of_the_avx2_build(prefill_kernel.SOURCE, _AVX2_RUN, cases, tmp_path)
    for (q, k, v, count, window, scale), got in zip(cases, avx2, strict=True):
        expected = attention._fresh_batch_sdpa(q, k, v, count, Scores(scale, window))
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_without_a_compiler_prefill_falls_back_to_sdpa_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached build either
    prefill_kernel.prefill_kernel_available.cache_clear()
    q, k, v = _qkv(5, 3, 3, 32, torch.bfloat16, torch.Generator().manual_seed(0))
    try:
        with caplog.at_level(logging.WARNING, logger=prefill_kernel.__name__):
            assert not prefill_kernel.takes_prefill(q, k, v)
            assert not prefill_kernel.prefill_kernel_available()  # decided once
            out = attention._fresh_batch(q, k, v, 1, Scores(SCALE, 0))
        (record,) = caplog.records
        assert "prefill attention uses torch SDPA" in record.message and "/nonexistent/g++" in record.message
        torch.testing.assert_close(out, attention._fresh_batch_sdpa(q, k, v, 1, Scores(SCALE, 0)))
    finally:
        prefill_kernel.prefill_kernel_available.cache_clear()
