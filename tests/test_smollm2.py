"""The embedded SmolLM2-135M-Instruct (real weights, GGUF), its decode captured (--capture
always): engine greedy output == HF transformers for a batch of 3 and for a batch of 1 (padded
in the compiled program), and the decode steps ran compiled."""

import pytest
import torch

from kvferry.config import CaptureMode
from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams
from kvferry_bench.hf_reference import load_hf_reference

# slow: the 135M SmolLM2 compiled, and HF transformers' generate (make test-all only)
pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    """Captured: the compiled decode program, kept whatever a start-up measurement would say."""
    return LLM(
        str(smollm2_gguf),
        dtype="float32",
        kv_cache_bytes=256 << 20,
        max_model_len=1024,
        capture=CaptureMode.ALWAYS,
    )


def test_capital_of_france_is_paris(llm):
    out = llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(max_tokens=32, temperature=0))
    assert "Paris" in out[0].outputs[0].text


@pytest.fixture(scope="module")
def hf(llm):  # noqa: ANN001, ANN201 - the transformers model
    """HF transformers' model of the same checkpoint, float32: the greedy reference."""
    return load_hf_reference(llm.config.model, torch.float32)


@torch.inference_mode()
def _hf_greedy(hf, prompt_token_ids: list[int]) -> list[int]:  # noqa: ANN001 - the transformers model
    """HF generate's greedy continuation: it stops after the EOS token (<|im_end|>) or at
    MAX_NEW tokens, as the engine does."""
    ids = torch.tensor([prompt_token_ids])
    ref = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0
    )
    return ref[0, ids.shape[1] :].tolist()


def _chat_prompts(llm: LLM) -> list:
    return [llm.inputs.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def test_greedy_batch_identical_to_hf(llm, hf):
    prompts = _chat_prompts(llm)
    ours = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0))
    for prompt, out in zip(prompts, ours, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, out.prompt_token_ids), prompt
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_captured_greedy_of_one_equals_hf(llm, hf):
    """A question alone: a decode batch of 1, padded to 2 in the compiled program, equal to
    HF generate (the batch of 3 is test_greedy_batch_identical_to_hf's)."""
    prompt = _chat_prompts(llm)[1]
    (before,) = [s.compiled_steps for s in llm.engine.executor.capture_stats()]
    (alone,) = llm.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0))
    (after,) = [s.compiled_steps for s in llm.engine.executor.capture_stats()]
    assert after > before  # its decode steps ran compiled
    assert list(alone.outputs[0].token_ids) == _hf_greedy(hf, alone.prompt_token_ids)
