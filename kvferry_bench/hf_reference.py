"""HF transformers reference models on exactly the weights kvferry loads (tests and benches)."""

from __future__ import annotations

import torch

from kvferry.config import ModelConfig


def load_hf_reference(model_config: ModelConfig, dtype: torch.dtype | None = None):
    """An HF CausalLM with the same weights; GGUF weights are dequantized the same way kvferry does."""
    from transformers import AutoModelForCausalLM

    dtype = dtype or model_config.dtype
    if model_config.gguf_file is None:
        model = AutoModelForCausalLM.from_pretrained(model_config.local_dir, dtype=dtype)
    else:
        from kvferry.model.loader import gguf_state_dict

        model = AutoModelForCausalLM.from_config(model_config.hf_config, dtype=dtype)
        missing, unexpected = model.load_state_dict(gguf_state_dict(model_config.gguf_file), strict=False)
        missing = [name for name in missing if name != "lm_head.weight"]  # tied to the embedding
        assert not missing and not unexpected, (missing, unexpected)
        model.tie_weights()
        model.to(dtype)
    return model.eval()


@torch.inference_mode()
def hf_generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    pad_token_id: int = 0,
) -> list[list[int]]:
    """Batched generate with left padding (greedy at temperature 0); the new tokens per
    prompt (no padding)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        **(
            {"do_sample": True, "temperature": temperature, "top_p": top_p}
            if temperature > 0
            else {"do_sample": False}
        ),
    )
    return [row[width:].tolist() for row in out]
