"""The fused decode layer (kvferry.model.layers.fused_decode): one operator call per
Llama-family layer on an all-decode step, on float32 tiles and under --quantization gguf.

Its matmuls and attention are the kernel library's own, so a decode step through it equals
the operator-by-operator layer up to float32 rounding of the norms, rope and activation
(under gguf amplified now and then by the int8 rounding of the matmuls' inputs); its rows do not depend
on each other (speculative decoding's verification needs that); steps it does not serve
(a prefill in the step, connector hooks on the layer) take the unfused layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from kvferry.engine.llm import LLM
from kvferry.kv.spec import Layout
from kvferry.model.forward_context import HookPlacement
from kvferry.model.layers.float32_kernel import tile
from kvferry.model.layers.fused_decode import SOURCE, FusedDecodeLayer, fused_decode_available
from kvferry.model.loader import load_model
from kvferry.model.resolve import resolve_model_config
from kvferry.sampling_params import SamplingParams
from kvferry.worker.capture import FUSED_LAYERS_STAY_EAGER
from kvferry_bench.hf_reference import load_hf_reference
from tests.avx2_build import outputs_of_the_avx2_build
from tests.engine_helpers import assert_pool_full
from tests.fixtures.paged import Chunk, PagedDriver
from tests.fixtures.tiny_gguf import write_tiny_gguf
from tests.test_gguf_quant import GGUF_LOGPROB_TOLERANCE, gguf_reference
from tests.test_int4 import MAX_NEW, QUESTIONS, eager_smollm2, steps_equal_to_reference

pytestmark = pytest.mark.skipif(not fused_decode_available(), reason="no C++ compiler for the CPU kernels")

PROMPTS = {"a": [5, 9, 13, 200, 31, 77, 8], "b": [3, 1, 4, 1, 5, 9, 2, 6, 5], "c": [40, 41]}
DECODE_STEPS = 6


# the fused operator's elementwise loops against torch's operators: logits have differed by
# 2e-6 at most (tiny Llama and Qwen2, values up to 6; 2026-11-29, AVX-512 host); an int8
# rounding of a matmul's input tipped by that difference would move them by ~1e-3
LOGIT_TOLERANCE = 5e-3


@pytest.fixture(scope="module")
def tiny_gguf_path(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tiny_llama, tmp_path_factory.mktemp("fused") / "tiny.gguf", quantize=True)


def _gguf_model(path: Path) -> torch.nn.Module:
    return load_model(resolve_model_config(str(path), dtype="float32", quantization="gguf"))


@pytest.fixture(scope="module")
def model(tiny_gguf_path: Path) -> torch.nn.Module:
    return _gguf_model(tiny_gguf_path)


@pytest.fixture(scope="module")
def float32_model(tiny_llama: Path) -> torch.nn.Module:
    """The tiny Llama in float32: its linears are float32 tiles."""
    return load_model(resolve_model_config(str(tiny_llama), dtype="float32"))


@pytest.fixture(scope="module")
def qwen2_model(tiny_qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """q/k/v biases, which the fused operator adds."""
    return _gguf_model(
        write_tiny_gguf(tiny_qwen2, tmp_path_factory.mktemp("fused") / "qwen2.gguf", quantize=True)
    )


class FusedCalls:
    """Counts the layers that took the fused path."""

    def __init__(self) -> None:
        self.count = 0


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> FusedCalls:
    calls = FusedCalls()
    run = FusedDecodeLayer.run

    def counted(self, *args):  # type: ignore[no-untyped-def]
        out = run(self, *args)
        calls.count += out is not None
        return out

    monkeypatch.setattr(FusedDecodeLayer, "run", counted)
    return calls


@contextlib.contextmanager
def _unfused_ctx(model: torch.nn.Module) -> Iterator[None]:
    saved = [layer.fused_decode for layer in model.model.layers]
    for layer in model.model.layers:
        layer.fused_decode = None
    try:
        yield
    finally:
        for layer, fused in zip(model.model.layers, saved, strict=True):
            layer.fused_decode = fused


def _greedy_decode(model: torch.nn.Module, layout: Layout, names: list[str]) -> list[torch.Tensor]:
    """Each prompt prefilled alone, then DECODE_STEPS greedy steps of them all in one batch:
    the logits of every decode step."""
    driver = PagedDriver(model, num_blocks=64, block_size=4, layout=layout)
    last = {name: driver.step([Chunk(name, PROMPTS[name])])[name][-1] for name in names}
    steps = []
    for _ in range(DECODE_STEPS):
        chunks = [Chunk(name, [int(last[name].argmax())], decode=True) for name in names]
        out = driver.step(chunks)
        steps.append(torch.stack([out[name][0] for name in names]))
        last = {name: out[name][0] for name in names}
    return steps


@torch.inference_mode()
@pytest.mark.parametrize(
    ("fixture", "layout"),
    [
        ("model", Layout.NHD),
        ("model", Layout.HND),
        ("qwen2_model", Layout.NHD),
        ("float32_model", Layout.NHD),
    ],
)
def test_decode_steps_take_the_fused_layer_and_equal_the_unfused(request, fused_calls, fixture, layout):
    model = request.getfixturevalue(fixture)
    layers = len(model.model.layers)
    assert all(layer.fused_decode is not None for layer in model.model.layers)
    fused = _greedy_decode(model, layout, ["a", "b", "c"])
    assert fused_calls.count == DECODE_STEPS * layers  # the prompts' steps took the unfused layer
    with _unfused_ctx(model):
        unfused = _greedy_decode(model, layout, ["a", "b", "c"])
    for ours, theirs in zip(fused, unfused, strict=True):
        torch.testing.assert_close(ours, theirs, atol=LOGIT_TOLERANCE, rtol=0)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@contextlib.contextmanager
def _sliding_window(model: torch.nn.Module, window: int) -> Iterator[None]:
    attentions = [layer.self_attn.attn for layer in model.model.layers]
    for attention in attentions:
        attention.sliding_window = window
    try:
        yield
    finally:
        for attention in attentions:
            attention.sliding_window = None


@torch.inference_mode()
def test_a_sliding_window_clips_the_fused_attention_as_the_unfused(model, fused_calls):
    """Every layer seeing its last 4 positions (prompts of 2 to 9 tokens, 6 more decoded):
    equal to the unfused layer, and apart from full attention (the window reached the
    kernel)."""
    with _sliding_window(model, 4):
        fused = _greedy_decode(model, Layout.NHD, ["a", "b", "c"])
        with _unfused_ctx(model):
            unfused = _greedy_decode(model, Layout.NHD, ["a", "b", "c"])
    full = _greedy_decode(model, Layout.NHD, ["a", "b", "c"])
    assert fused_calls.count == 2 * DECODE_STEPS * len(model.model.layers)
    for ours, theirs in zip(fused, unfused, strict=True):
        torch.testing.assert_close(ours, theirs, atol=LOGIT_TOLERANCE, rtol=0)
    assert not torch.allclose(fused[-1], full[-1], atol=1e-2)


@torch.inference_mode()
@pytest.mark.parametrize("fixture", ["model", "float32_model"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(request, fused_calls, fixture):
    model = request.getfixturevalue(fixture)
    alone = _greedy_decode(model, Layout.NHD, ["a"])
    batched = _greedy_decode(model, Layout.NHD, ["b", "a", "c"])
    assert fused_calls.count == 2 * DECODE_STEPS * len(model.model.layers)
    for single, rows in zip(alone, batched, strict=True):
        assert torch.equal(single[0], rows[1])


class RecordingHooks:
    """Per-layer connector hooks that only count their calls."""

    def __init__(self) -> None:
        self.saved = 0

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor, attn: object) -> None:
        self.saved += 1


@torch.inference_mode()
def test_steps_it_does_not_serve_take_the_unfused_layer(model, fused_calls):
    """A decode sharing its step with a prefill, and a layer with connector hooks."""
    driver = PagedDriver(model, num_blocks=64, block_size=4)
    first = driver.step([Chunk("a", PROMPTS["a"])])["a"][-1]
    driver.step([Chunk("a", [int(first.argmax())], decode=True), Chunk("b", PROMPTS["b"])])
    assert fused_calls.count == 0
    hooks = RecordingHooks()
    hooked = PagedDriver(model, num_blocks=64, block_size=4, hooks=hooks)
    try:
        first = hooked.step([Chunk("a", PROMPTS["a"])])["a"][-1]
        hooked.step([Chunk("a", [int(first.argmax())], decode=True)])
    finally:
        model.set_hook_placement(HookPlacement.NONE)
    assert fused_calls.count == 0
    assert hooks.saved == 2 * len(model.model.layers)  # the decode step called them too


@torch.inference_mode()
def test_an_engine_decodes_through_it_as_the_gguf_reference_does(smollm2_gguf, fused_calls):
    """The embedded SmolLM2 (Q4_1 layers, a Q8_0 LM head) in the engine's own runner (its
    metadata, micro-batching, sampling), eager: greedy answers and logprobs as transformers
    computing the kernel's arithmetic (tests.test_gguf_quant). Three questions whose answers
    met no near-tie of the reference's early on here (17, 23 and 24 of 24 steps compared;
    every question is in the slow tier's test_smollm2_gguf_greedy_equals_its_reference)."""
    llm = eager_smollm2(smollm2_gguf, "gguf")
    prompts = [llm.inputs.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS[2:5]]
    ours = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=1))
    assert fused_calls.count >= (MAX_NEW - 1) * 30  # SmolLM2's 30 layers, every decode step
    reference = gguf_reference(load_hf_reference(llm.config.model, torch.float32))
    assert steps_equal_to_reference(reference, ours, GGUF_LOGPROB_TOLERANCE) >= MAX_NEW
    assert_pool_full(llm)


@pytest.mark.parametrize("quantization", ["gguf", "none"], ids=["gguf", "float32"])
def test_capture_auto_compiles_nothing_when_every_layer_decodes_fused(smollm2_gguf, tmp_path, quantization):
    """The compiled program would run the layers operator by operator: --capture auto keeps
    decode steps eager without compiling one (torch's counter of compiled graphs)."""
    before = int(dynamo_utils.counters["stats"]["unique_graphs"])
    llm = LLM(str(smollm2_gguf), quantization=quantization, capture="auto", cache_dir=str(tmp_path),
              kv_cache_bytes=64 << 20, max_model_len=256)  # fmt: skip
    decision = llm.engine.capture_decision
    assert not decision.compiled and decision.not_compiled == FUSED_LAYERS_STAY_EAGER
    assert decision.describe().endswith(f"({FUSED_LAYERS_STAY_EAGER})")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    assert int(dynamo_utils.counters["stats"]["unique_graphs"]) == before
    (stats,) = llm.engine.executor.capture_stats()
    assert stats.compiled_steps == 0 and stats.compile_seconds == 0.0
    assert_pool_full(llm)


@torch.inference_mode()  # the 135M SmolLM2 (~3 s): on the tiny models torch's results coincide
@pytest.mark.parametrize("quantization", ["gguf", "none"], ids=["gguf", "float32"])
def test_a_decode_sharing_a_step_with_a_prefill_gets_the_bits_of_a_decode_step(
    smollm2_gguf, fused_calls, quantization
):
    """A step the one-call path does not take (a decode beside a prefill) runs the same code
    in parts, so the decode row's logits are, bit for bit, those of a step of decodes only:
    a P/D decoder's steps and a colocated engine's mixed ones answer alike. (With torch's
    operators in the mixed step this equality failed.)"""
    model = load_model(resolve_model_config(str(smollm2_gguf), dtype="float32", quantization=quantization))
    layers = len(model.model.layers)

    def decoded(driver: PagedDriver, token: int, beside: list[Chunk]) -> torch.Tensor:
        return driver.step([Chunk("a", [token], decode=True), *beside])["a"][0]

    alone = PagedDriver(model, num_blocks=64, block_size=16)
    token = int(alone.step([Chunk("a", PROMPTS["a"])])["a"][-1].argmax())
    pure = decoded(alone, token, [])
    assert fused_calls.count == layers
    mixed = PagedDriver(model, num_blocks=64, block_size=16)
    mixed.step([Chunk("a", PROMPTS["a"])])
    beside_a_prefill = decoded(mixed, token, [Chunk("b", PROMPTS["b"])])
    assert fused_calls.count == layers  # the mixed step: in parts
    assert torch.equal(pure, beside_a_prefill)


_AVX2_TAIL = """
import sys, torch
from kvferry.model.layers.float32_kernel import float32_kernel_available
assert float32_kernel_available()  # the matmul the layer calls (its builds agree: test_float32_kernel)
torch.ops.load_library(sys.argv[1])
cases = torch.load(sys.argv[2])
outs = []
for attended, residual, norm, o, gate_up, down, intermediate in cases:
    outs.append(torch.ops.kvferry_cpu.layer_tail(attended, residual.clone(), norm, 1e-5, o, 0, None, gate_up, 0,
                                                 down, 0, intermediate))
torch.save(outs, sys.argv[3])
"""


@pytest.mark.slow  # builds the AVX2 library (~15 s)
def test_the_avx2_build_of_the_layer_tail_computes_this_machines_bits(tmp_path: Path) -> None:
    """The code after the attention (output projection, residual add and norm, SiLU x up,
    down projection) of the AVX2 build equals this machine's, bit for bit: MLP widths of 40
    (16-lane vectors and a scalar tail on AVX-512, 8-lane ones on AVX2) and 64, gates far
    into both tails of the sigmoid."""
    gen = torch.Generator().manual_seed(2)
    cases, ours = [], []
    for intermediate in (40, 64):
        hidden = 32
        weights = [torch.randn(rows, cols, generator=gen) * scale for rows, cols, scale in
                   ((hidden, hidden, 0.2), (2 * intermediate, hidden, 3.0), (hidden, intermediate, 0.2))]  # fmt: skip
        o, gate_up, down = (tile(weight) for weight in weights)
        attended, residual = torch.randn(5, hidden, generator=gen), torch.randn(5, hidden, generator=gen)
        norm = torch.rand(hidden, generator=gen) + 0.5
        cases.append((attended, residual, norm, o, gate_up, down, intermediate))
        ours.append(
            torch.ops.kvferry_cpu.layer_tail(
                attended, residual.clone(), norm, 1e-5, o, 0, None, gate_up, 0, down, 0, intermediate
            )  # fmt: skip
        )
    theirs = outputs_of_the_avx2_build(SOURCE, _AVX2_TAIL, cases, tmp_path)
    for mine, avx2 in zip(ours, theirs, strict=True):
        assert torch.equal(mine, avx2)
