"""Load the tokenizer of a resolved model (HF directory or GGUF file), offline.

Converting a GGUF vocabulary to a fast tokenizer takes seconds, so the converted
tokenizer is saved once under kvferry's cache directory (kvferry.cache_dir)/tokenizers,
keyed by the GGUF file's path, size, mtime and the transformers version.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvferry.cache_dir import default_cache_dir
from kvferry.config import ModelConfig
from kvferry.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Used only when a checkpoint ships no chat template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _gguf_chat_template(gguf_file: str) -> str | None:
    from kvferry.model.loader.gguf_config import open_gguf

    template = open_gguf(gguf_file).fields.get("tokenizer.chat_template")
    return template if isinstance(template, str) else None


def gguf_tokenizer_cache_dir(gguf_file: str | Path) -> Path:
    """Where the converted tokenizer of `gguf_file` is kept."""
    import transformers

    path = Path(gguf_file).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return default_cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:20]


def _save_to_cache(tokenizer: PreTrainedTokenizerBase, cache_dir: Path) -> None:
    """Save atomically (temp dir + rename); a failure only costs speed next time."""
    try:
        cache_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache_dir.parent, prefix=".tmp-"))
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)
        os.replace(tmp, cache_dir)
    except OSError as err:
        logger.debug("could not cache the GGUF tokenizer in %s: %s", cache_dir, err)


def _load_gguf_tokenizer(gguf_file: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    cache_dir = gguf_tokenizer_cache_dir(gguf_file)
    if (cache_dir / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(cache_dir, local_files_only=True)
        except (OSError, ValueError) as err:
            logger.warning("ignoring the bad cached tokenizer in %s: %s", cache_dir, err)
    gguf = Path(gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = _gguf_chat_template(gguf_file)
    _save_to_cache(tokenizer, cache_dir)
    return tokenizer


def load_tokenizer(model_config: ModelConfig) -> PreTrainedTokenizerBase:
    """A transformers tokenizer for `model_config`, with a chat template set."""
    from transformers import AutoTokenizer

    try:
        if model_config.gguf_file is not None:
            tokenizer = _load_gguf_tokenizer(model_config.gguf_file)
        else:
            local_dir = model_config.local_dir or model_config.model
            tokenizer = AutoTokenizer.from_pretrained(local_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"cannot load the tokenizer of {model_config.model!r}: {err}") from err
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("%s ships no chat template; using ChatML", model_config.model)
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer
