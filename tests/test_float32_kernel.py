"""kvferry's float32 tile matmul (csrc/float32_matmul.cpp) against the float64 reference,
its portable loop, itself at other row and thread counts, and its AVX2 build.

Every output is a fused multiply-add over the inputs in order, then the bias: the vector
path this machine's library was built for must give the portable loop's bits, a row must
give the same bits alone and among 2,047 others (batch invariance), and the AVX2 build the
same bits as this machine's. A float32 model's linears must take these tiles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvferry.model.layers.float32_kernel import (
    SOURCE,
    float32_kernel_available,
    float32_kernel_isa,
    float32_matmul,
    tile,
)
from kvferry.model.layers.linear import PackableLinear
from kvferry.model.layers.packed import PackedForm, PackedWeight, pack, packed_linear
from kvferry.sampling_params import SamplingParams
from tests.avx2_build import outputs_of_the_avx2_build
from tests.engine_helpers import make_llm

pytestmark = pytest.mark.skipif(not float32_kernel_available(), reason="no C++ compiler for the CPU kernels")

# (out features, in features): a panel's tail of 8 and of 1, fewer than a tile, SmolLM2's
SHAPES = ((40, 24), (17, 5), (3, 64), (96, 100), (960, 576), (576, 1536))


def _weight(out: int, inputs: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(out, inputs, generator=gen) * 0.05, torch.randn(out, generator=gen)


def test_tiles_hold_the_weight_transposed_per_16_features_and_zeros_past_it() -> None:
    weight = torch.arange(17 * 3, dtype=torch.float32).view(17, 3)
    tiles = tile(weight)
    assert tiles.shape == (2, 3, 16)  # padded to a pair of tiles
    assert torch.equal(tiles[0, 2], weight[:16, 2])
    assert tiles[1, 1, 0] == weight[16, 1] and not tiles[1, :, 1:].any()


@pytest.mark.parametrize(("out", "inputs"), SHAPES)
def test_outputs_are_the_float64_product_within_float32_rounding(out: int, inputs: int) -> None:
    gen = torch.Generator().manual_seed(out * inputs)
    weight, bias = _weight(out, inputs, gen)
    x = torch.randn(13, inputs, generator=gen)
    got = float32_matmul(x, tile(weight), bias, out)
    exact = x.double() @ weight.double().T + bias.double()
    bound = (x.double().abs() @ weight.double().abs().T + bias.double().abs()) * inputs * 2.0**-23
    assert got.shape == (13, out)
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(("out", "inputs"), SHAPES)
def test_the_vector_path_gives_the_portable_loops_bits(out: int, inputs: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(out + inputs)
    weight, bias = _weight(out, inputs, gen)
    x = torch.randn(29, inputs, generator=gen)  # two full register groups and a partial one
    tiles, b = tile(weight), bias if with_bias else None
    assert torch.equal(float32_matmul(x, tiles, b, out), float32_matmul(x, tiles, b, out, portable=True))


def test_a_row_gets_the_same_bits_alone_among_others_and_on_one_thread() -> None:
    """Batch invariance across the register groups (12 rows), the row blocks (96) and the
    threads: what speculative decoding's verification and P/D's byte identity rest on."""
    gen = torch.Generator().manual_seed(3)
    weight, bias = _weight(576, 1536, gen)
    tiles = tile(weight)
    x = torch.randn(2047, 1536, generator=gen)
    every = float32_matmul(x, tiles, bias, 576)
    for rows in (1, 2, 11, 12, 13, 95, 96, 97, 500):
        assert torch.equal(float32_matmul(x[:rows], tiles, bias, 576), every[:rows]), rows
    for row in (0, 1000, 2046):
        assert torch.equal(float32_matmul(x[row : row + 1], tiles, bias, 576)[0], every[row]), row
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(float32_matmul(x[:200], tiles, bias, 576), every[:200])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("out", "inputs"), [(40, 72), (576, 1544)], ids=["rows-shared", "panels-shared"])
def test_both_ways_of_sharing_the_work_give_the_portable_loops_bits(out: int, inputs: int) -> None:
    """A weight of few panels and many rows splits the rows among threads (40 features:
    fewer panels than 4 a thread on the AVX-512 and the AVX2 path alike); otherwise the
    panels are split. Either way, and on one thread, every row has the reference's bits."""
    gen = torch.Generator().manual_seed(out)
    weight, bias = _weight(out, inputs, gen)
    tiles = tile(weight)
    x = torch.randn(437, inputs, generator=gen)
    reference = float32_matmul(x, tiles, bias, out, portable=True)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(float32_matmul(x, tiles, bias, out), reference), count
    finally:
        torch.set_num_threads(threads)


def test_a_float32_weight_is_packed_as_tiles_and_multiplied_by_them() -> None:
    """The fast path is taken: the packed weight holds tiles, no oneDNN tensor, and the
    operator's answer is the kernel's bits (oneDNN's differ in the last bits)."""
    gen = torch.Generator().manual_seed(5)
    weight, bias = _weight(960, 576, gen)
    packed = pack(weight)
    assert packed.tiles is not None and packed.onednn is None
    x = torch.randn(3, 7, 576, generator=gen)  # leading dims are flattened and restored
    got = packed_linear(x, packed, bias)
    assert got.shape == (3, 7, 960)
    assert torch.equal(got.view(21, 960), float32_matmul(x.view(21, 576), tile(weight), bias, 960))
    onednn = packed_linear(x, pack(weight, PackedForm.ONEDNN), bias)
    assert not torch.equal(got, onednn)  # a different summation order: the test sees which ran
    torch.testing.assert_close(got, onednn)
    assert packed_linear(torch.empty(0, 576), packed).shape == (0, 960)


def test_a_bfloat16_weight_keeps_onednns_form() -> None:
    assert pack(torch.randn(32, 32).bfloat16()).tiles is None


_AVX2_RUN = """
import sys, torch
torch.ops.load_library(sys.argv[1])
assert torch.ops.kvferry_cpu.float32_matmul_isa() == "avx2"
cases = torch.load(sys.argv[2])
torch.save([torch.ops.kvferry_cpu.float32_matmul(x, tiles, bias, out, False) for x, tiles, bias, out in cases],
           sys.argv[3])
"""


@pytest.mark.slow  # builds the AVX2 library (~15 s)
def test_the_avx2_build_computes_the_bits_of_this_machines_build(tmp_path: Path) -> None:
    """Every output of the AVX2 build (a panel of one tile, 6 rows a group) equals this
    machine's library's (on an AVX-512 CPU two tiles, 12 rows), bit for bit: a greedy
    answer does not depend on which CPU kind served it."""
    gen = torch.Generator().manual_seed(11)
    cases = []
    for out, inputs in SHAPES:
        weight, bias = _weight(out, inputs, gen)
        for rows in (1, 5, 6, 7, 30):
            cases.append((torch.randn(rows, inputs, generator=gen), tile(weight), bias, out))
    avx2 = outputs_of_the_avx2_build(SOURCE, _AVX2_RUN, cases, tmp_path)
    for (x, tiles, bias, out), theirs in zip(cases, avx2, strict=True):
        assert torch.equal(float32_matmul(x, tiles, bias, out), theirs), (out, x.shape)


def test_the_library_names_a_vector_path_on_a_cpu_with_avx2() -> None:
    assert float32_kernel_isa() in ("avx512", "avx2")


def test_a_float32_engine_multiplies_every_linear_on_the_tiles(tiny_llama: Path) -> None:
    """Loaded weights are tiles (no oneDNN copy), and a greedy answer's steps run the tile
    kernel and no oneDNN linear (the profile fails this if any linear keeps oneDNN)."""
    llm = make_llm(tiny_llama)
    model = llm.engine.executor.worker.runner.model
    linears = [module for module in model.modules() if isinstance(module, PackableLinear)]
    assert linears and all(isinstance(m.packed, PackedWeight) and m.packed.tiles is not None for m in linears)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        (out,) = llm.generate(
            [{"prompt_token_ids": list(range(5, 25))}], SamplingParams(max_tokens=4, temperature=0)
        )
    assert len(out.outputs[0].token_ids) == 4
    calls = {event.key: event.count for event in profile.key_averages()}
    assert calls.get("kvferry_cpu::float32_matmul", 0) >= 4 * len(linears)
    assert not any("linear_pointwise" in key for key in calls), sorted(calls)
