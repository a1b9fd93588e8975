"""The tiny model fixtures build valid, deterministic HF checkpoints."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from tests.fixtures.tiny_models import build_tiny_model


def test_tiny_model_loads_in_transformers(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert tok.eos_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert model.config.vocab_size == len(tok)
    messages = [{"role": "user", "content": "Hi"}]
    chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("The cat sees a red ball", return_tensors="pt").input_ids
    assert tok.decode(ids[0], skip_special_tokens=True) == "The cat sees a red ball"
    logits = model(ids).logits[0, -1]
    assert torch.isfinite(logits).all()


def test_llama_adds_bos(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert tok("hello").input_ids[0] == tok.bos_token_id == 3


@pytest.mark.parametrize("arch", ["qwen3"])
def test_build_is_deterministic(arch: str, tmp_path: Path) -> None:
    digests = []
    for sub in ("a", "b"):
        out = build_tiny_model(arch, tmp_path / sub)
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()})
    assert digests[0] == digests[1]


def test_smollm2_gguf_present(smollm2_gguf: Path) -> None:
    assert smollm2_gguf.stat().st_size > 50_000_000
