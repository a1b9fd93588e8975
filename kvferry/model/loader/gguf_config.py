"""GGUF metadata -> a transformers config (llama, qwen2 and qwen3 GGUF architectures)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvferry.errors import ModelLoadError
from kvferry.model.loader.gguf_reader import GGUFFile

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> HF architecture name
GGUF_ARCHITECTURES = MappingProxyType(
    {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
)


@dataclass(frozen=True)
class GGUFModelInfo:
    hf_config: Any  # transformers.PretrainedConfig
    architecture: str
    eos_token_ids: tuple[int, ...]


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed header of a GGUF file (tensor data stays memory-mapped)."""
    return GGUFFile(path)


def _rope_parameters(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 1e4)),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling in (None, "none"):
        return rope
    if scaling != "linear":
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported (only linear)")
    rope.update(rope_type="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
    return rope


def _config_kwargs(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    vocab = meta.get(f"{arch}.vocab_size") or meta.get("_num_tokens")
    if vocab is None:  # neither the key nor the tokenizer's token list to count
        raise KeyError(f"{arch}.vocab_size")
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    return dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        num_hidden_layers=int(meta[f"{arch}.block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim or hidden // heads),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=_rope_parameters(meta, arch),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        dtype="float32",
    )


def _config_class(arch: str) -> type:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]


def _eos_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def gguf_model_info(path: str | Path, reader: GGUFFile | None = None) -> GGUFModelInfo:
    """Build the transformers config of a GGUF checkpoint from its metadata."""
    reader = reader if reader is not None else open_gguf(path)
    meta = dict(reader.fields)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {str(path)!r} has architecture {arch!r}, which kvferry does not support; "
            f"supported GGUF architectures: {', '.join(GGUF_ARCHITECTURES)}"
        )
    if "tokenizer.ggml.tokens" in meta:
        meta["_num_tokens"] = len(meta["tokenizer.ggml.tokens"])
    architecture = GGUF_ARCHITECTURES[arch]
    try:
        kwargs = _config_kwargs(meta, arch, reader.tensor_names())
    except KeyError as err:
        raise ModelLoadError(f"GGUF file {str(path)!r} lacks metadata key {err}") from err
    config = _config_class(arch)(**kwargs, architectures=[architecture])
    logger.debug("GGUF %s: %s with %d layers", path, architecture, config.num_hidden_layers)
    return GGUFModelInfo(hf_config=config, architecture=architecture, eos_token_ids=_eos_ids(meta))
