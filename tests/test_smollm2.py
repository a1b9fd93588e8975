"""The embedded SmolLM2-135M-Instruct (real weights, GGUF): engine greedy output == HF transformers,
and its captured forward (--capture always) == --enforce-eager, batches of 3 and of 1 (padded)."""

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


def _engine(path, capture: CaptureMode, **options) -> LLM:
    return LLM(
        str(path), dtype="float32", kv_cache_bytes=256 << 20, max_model_len=1024, capture=capture, **options
    )


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    """Captured: the compiled decode program, kept whatever a start-up measurement would say."""
    return _engine(smollm2_gguf, CaptureMode.ALWAYS)


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


def test_captured_greedy_equals_enforce_eager(llm, smollm2_gguf):
    """The batch of 3 and each question alone (a decode batch of 1, padded to 2 when compiled)."""
    prompts = [llm.inputs.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)

    def greedy(engine: LLM) -> list[list[int]]:
        batched = engine.generate(prompts, params)
        alone = engine.generate(prompts[1:2], params)
        return [list(o.outputs[0].token_ids) for o in (*batched, *alone)]

    (before,) = [s.compiled_steps for s in llm.engine.executor.capture_stats()]
    captured = greedy(llm)
    (after,) = [s.compiled_steps for s in llm.engine.executor.capture_stats()]
    assert after > before  # decode steps ran compiled
    eager = _engine(smollm2_gguf, CaptureMode.NEVER, max_num_batched_tokens=256)  # a shorter profiling step
    try:
        assert greedy(eager) == captured
    finally:
        eager.engine.shutdown()
