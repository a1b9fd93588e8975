"""Read GGUF tensors as float32 torch tensors under transformers' parameter names."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from kvferry.errors import ModelLoadError
from kvferry.model.loader.gguf_reader import GGUFFile

logger = logging.getLogger(__name__)

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str:
    """transformers' name for a GGUF tensor name; ModelLoadError for unknown tensors."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = BLOCK_RE.match(gguf_name)
    if match is None or match.group(2) not in BLOCK_NAMES:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not supported")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{BLOCK_NAMES[part]}.{kind}"


def unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs -> rotate-half halves).

    llama.cpp stores each head's rows as pairs (x0, x_half, x1, x_half+1, ...); transformers
    expects the first half of the head's rows, then the second half.
    """
    rows = weight.shape[0]
    per_head = rows // num_heads
    shaped = weight.reshape(num_heads, per_head // 2, 2, *weight.shape[1:])
    return shaped.transpose(1, 2).reshape(weight.shape)


def iter_gguf_weights(path: str | Path, reader: GGUFFile | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for each tensor of a GGUF checkpoint."""
    reader = reader if reader is not None else GGUFFile(path)
    meta = reader.fields
    arch = meta.get("general.architecture")
    heads = int(meta.get(f"{arch}.attention.head_count", 0))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            raise ModelLoadError("GGUF rope_freqs (llama 3.1 rope scaling) is not supported")
        name = hf_name(tensor.name)
        value = reader.dequantize(tensor)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            value = unpermute_rope(value, heads if ".q_proj." in name else kv_heads)
        yield name, value


def gguf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The whole GGUF checkpoint dequantized to float32, in transformers' naming."""
    return dict(iter_gguf_weights(path))
