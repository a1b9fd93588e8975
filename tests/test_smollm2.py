"""The embedded SmolLM2-135M-Instruct (real weights, GGUF): engine greedy output == HF transformers."""

import pytest
import torch

from kvferry.bench.hf_reference import load_hf_reference
from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return LLM(str(smollm2_gguf), dtype="float32", kv_cache_bytes=256 << 20, max_model_len=1024)


def test_capital_of_france_is_paris(llm):
    out = llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(max_tokens=32, temperature=0))
    assert "Paris" in out[0].outputs[0].text


@torch.inference_mode()
def test_greedy_batch_identical_to_hf(llm):
    prompts = [llm.inputs.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    ours = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0))
    hf = load_hf_reference(llm.config.model, torch.float32)
    for prompt, out in zip(prompts, ours, strict=True):
        ids = torch.tensor([out.prompt_token_ids])
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            pad_token_id=0,
        )
        # Both stop after the EOS token (<|im_end|>) or at MAX_NEW tokens.
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), prompt
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_blocks
