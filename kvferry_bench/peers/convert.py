"""The model both engines load: an HF directory (config.json, tokenizer, model.safetensors).

A GGUF model (the embedded ``smollm2``) is dequantized by kvferry's own loader code (the
weights ``bench.hf_reference`` builds) and saved once per dtype; a model that already is
an HF directory is used as it is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_CACHE = Path("bench-results") / "peers-models"
DONE = ".kvferry-converted"


def converted_dir(gguf_file: str | Path, dtype: str, cache_root: Path = DEFAULT_CACHE) -> Path:
    """Where the HF copy of `gguf_file` in `dtype` is kept (keyed by the file's path, size, mtime)."""
    path = Path(gguf_file).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root / f"{path.stem}-{dtype}-{digest}"


def hf_model_dir(model: str, dtype: str, cache_root: Path = DEFAULT_CACHE) -> Path:
    """An HF directory holding `model` in `dtype`: converted (once) from GGUF, else its own dir."""
    from kvferry.model.resolve import resolve_model_config

    model_config = resolve_model_config(model, dtype=dtype)
    if model_config.gguf_file is None:
        return Path(model_config.local_dir or model)
    out = converted_dir(model_config.gguf_file, dtype, cache_root)
    if (out / DONE).is_file():
        logger.info("using the converted model in %s", out)
        return out
    logger.info("converting %s to an HF directory in %s (%s)", model_config.gguf_file, out, dtype)
    save_hf_copy(model_config, out)
    return out


def gguf_path(model: str) -> Path | None:
    """The GGUF file `model` is loaded from (None: an HF directory), for llama.cpp."""
    from kvferry.model.resolve import resolve_model_config

    gguf_file = resolve_model_config(model).gguf_file
    return Path(gguf_file) if gguf_file is not None else None


def save_hf_copy(model_config, out: Path) -> None:
    """Write config, tokenizer and safetensors of `model_config` to `out`, atomically."""
    from kvferry.model.tokenizer import load_tokenizer
    from kvferry_bench.hf_reference import load_hf_reference

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        model = load_hf_reference(model_config, model_config.dtype)
        model.generation_config.eos_token_id = list(model_config.eos_token_ids)
        model.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(model_config).save_pretrained(tmp)
        (tmp / DONE).write_text(f"{model_config.gguf_file}\n")
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
