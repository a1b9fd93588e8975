"""--quantization int4: weight-only int4 linears (kvferry.model.layers.int4).

The reference for the int4 path is its own arithmetic done plainly: transformers' model
whose decoder linears, for calls of few rows (decode), multiply bfloat16-rounded inputs
by the int4 weight dequantized and round the result to bfloat16 (what the kernel does),
in float32 (per linear, that is the kernel's arithmetic exactly). Greedy tokens must equal
that reference on the fixture prompts and the chosen tokens' logprobs agree within 0.1,
except from a step where the reference's two best tokens are within that tolerance (a
near-tie, which the rest of the model's float32 rounding may break either way).
Calls of up to MAX_INT4_ROWS rows take the int4 kernel, larger ones the dense weight.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvferry.engine.llm import LLM
from kvferry.errors import ConfigError
from kvferry.model.layers.int4 import (
    GROUP_SIZE,
    MAX_INT4_ROWS,
    Int4Weight,
    can_quantize_int4,
    dequantize_groups,
    quantize_groups,
)
from kvferry.model.layers.linear import PackableLinear
from kvferry.model.layers.packed import pack
from kvferry.sampling_params import SamplingParams
from kvferry_bench.hf_reference import load_hf_reference
from tests.engine_helpers import assert_pool_full

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?",
    "List two uses of copper.",
]
MAX_NEW = 24
LOGPROB_TOLERANCE = 0.1


def test_a_gguf_q4_weight_round_trips_exactly():
    """Weights of GGUF Q4 form (q * d + m per group of 32, d and m exact in bf16) come back
    unchanged: for the embedded model int4 loses only the scales' rounding."""
    torch.manual_seed(0)
    groups = (128, 96 // GROUP_SIZE)
    d = (torch.rand(groups) * 0.02 + 0.001).bfloat16().float()
    m = (-8 * d + torch.randn(groups) * 0.001).bfloat16().float()
    q = torch.randint(0, 16, (*groups, GROUP_SIZE)).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantizer's block extremes, as GGUF's Q4_1 has them
    weight = (q * d[..., None] + m[..., None]).reshape(128, 96)
    assert torch.equal(dequantize_groups(*quantize_groups(weight)), weight)


def test_few_rows_take_int4_more_rows_the_dense_weight():
    torch.manual_seed(0)
    plain_weight = torch.randn(256, 192) * 0.05
    dense = pack(plain_weight)
    weight = Int4Weight(plain_weight, dense)
    assert weight.max_rows == MAX_INT4_ROWS[torch.float32]
    x = torch.randn(64, 192)
    few = x[: weight.max_rows]
    expected = (
        torch.nn.functional.linear(few.bfloat16().float(), _dequantized(plain_weight)).bfloat16().float()
    )
    assert torch.allclose(weight.linear(few, None), expected, atol=1e-6, rtol=0)
    for rows in range(1, weight.max_rows):
        assert torch.equal(weight.linear(x[:rows], None), weight.linear(few, None)[:rows])
    assert torch.equal(weight.linear(x, None), dense.linear(x, None))


def test_unknown_quantization_is_a_config_error(tiny_llama):
    with pytest.raises(ConfigError, match="quantization"):
        LLM(str(tiny_llama), quantization="int3")


def eager_smollm2(path: Path, quantization: str) -> LLM:
    """The embedded SmolLM2 in float32 under `quantization`, eager (the arithmetic is the subject)."""
    return LLM(str(path), dtype="float32", kv_cache_bytes=256 << 20, max_model_len=1024,
               quantization=quantization, enforce_eager=True)  # fmt: skip


def greedy_answers(llm: LLM) -> list:
    """QUESTIONS as chat prompts, answered greedily with the chosen tokens' logprobs."""
    prompts = [llm.inputs.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=1))


def steps_equal_to_reference(
    reference: torch.nn.Module, ours: list, tolerance: float = LOGPROB_TOLERANCE
) -> int:
    """Greedy steps of `ours` compared (not near-ties) with `reference` generating from the
    same prompts; each compared step must pick the reference's token, its logprob within
    `tolerance` of the reference's."""
    compared = 0
    for out in ours:
        ids = torch.tensor([out.prompt_token_ids])
        ref = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        compared += _same_greedy(
            out.outputs[0], ref.sequences[0, ids.shape[1] :].tolist(), ref.logits, tolerance
        )
    return compared


@pytest.mark.slow  # the 135M SmolLM2 in int4 and its reference
@torch.inference_mode()
def test_smollm2_int4_greedy_equals_its_reference(smollm2_gguf):
    """Eager: the int4 arithmetic is the subject (the default, --capture auto, compiled and
    timed 30 layers at start-up and could keep either forward on a noisy host)."""
    llm = eager_smollm2(smollm2_gguf, "int4")
    assert _int4_linears(llm) == 4 * 30  # per layer: qkv, o, gate_up, down (the LM head stays float32)
    ours = greedy_answers(llm)
    compared = steps_equal_to_reference(_int4_reference(llm), ours)
    assert compared >= len(QUESTIONS) * MAX_NEW // 2  # near-ties are rare: most steps were compared
    assert_pool_full(llm)


@pytest.mark.slow  # an engine and an HF reference generating
@torch.inference_mode()
def test_a_latent_attention_moe_model_runs_int4_and_equals_its_reference(tiny_moe):
    """The tiny DeepSeek-V3 (MLA, routed and shared experts) under int4: the linears whose
    shapes allow it are int4 (per layer q_a, q_b, kv_a and the dense or shared MLP's gate_up
    and down; not o_proj, 48 inputs; kv_b is absorbed into the attention; routed experts
    stay dense), and greedy tokens equal the reference doing that arithmetic plainly."""
    model_dir = tiny_moe("deepseek_v3")
    llm = LLM(
        str(model_dir), dtype="float32", kv_cache_bytes=5 << 20, quantization="int4", enforce_eager=True
    )
    assert _int4_linears(llm) == 5 * 3
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 800, (n,), generator=gen).tolist() for n in (12, 30, 47)]
    ours = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=1))
    compared = steps_equal_to_reference(_int4_reference(llm), ours)
    assert compared >= len(prompts) * MAX_NEW // 2
    assert_pool_full(llm)
    llm.engine.shutdown()


def _same_greedy(ours, ref_tokens: list[int], ref_logits: tuple[torch.Tensor, ...], tolerance: float) -> int:
    """Our tokens equal the reference's, our logprobs within tolerance, up to a step where
    the reference's own top two are within the tolerance (a near-tie either may break
    differently; the sequences part there). Returns the steps compared."""
    for step, (token, logits) in enumerate(zip(ours.token_ids, ref_logits, strict=False)):
        ref_logprobs = torch.log_softmax(logits[0].float(), -1)
        if token != ref_tokens[step]:
            margin = ref_logprobs[ref_tokens[step]] - ref_logprobs[token]
            assert margin < 2 * tolerance, f"step {step}: {token} vs {ref_tokens[step]}, margin {margin}"
            return step
        assert abs(ours.logprobs[step].sampled - ref_logprobs[token].item()) < tolerance, f"step {step}"
    return len(ours.token_ids)


def _int4_reference(llm: LLM) -> torch.nn.Module:
    """transformers' model computing what the int4 linears compute, plainly in float32:
    calls of up to MAX_INT4_ROWS rows take bf16 inputs times the dequantized weight,
    rounded to bf16; larger calls the dense weight. Linears whose shape int4 cannot take
    stay plain, as the engine keeps them."""
    model = load_hf_reference(llm.config.model, torch.float32)
    for layer in model.model.layers:
        for linear in (m for m in layer.modules() if isinstance(m, torch.nn.Linear)):
            if can_quantize_int4(linear.weight.data):
                linear.register_forward_hook(_int4_rows(_dequantized(linear.weight.data)))
    return model


def _int4_rows(dequantized: torch.Tensor):
    def hook(_module, args, out):
        x = args[0]
        if x.reshape(-1, x.shape[-1]).shape[0] > MAX_INT4_ROWS[torch.float32]:
            return out
        return torch.nn.functional.linear(x.bfloat16().float(), dequantized).bfloat16().float()

    return hook


def _dequantized(weight: torch.Tensor) -> torch.Tensor:
    return dequantize_groups(*quantize_groups(weight.float()))


def _int4_linears(llm: LLM) -> int:
    model = llm.engine.executor.worker.runner.model
    return sum(isinstance(m.packed, Int4Weight) for m in model.modules() if isinstance(m, PackableLinear))
