"""Load the tokenizer of a resolved model (HF directory or GGUF file), offline."""

from __future__ import annotations

import logging
from pathlib import Path

from kvferry.config import ModelConfig
from kvferry.errors import ModelLoadError

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

    field = open_gguf(gguf_file).fields.get("tokenizer.chat_template")
    return field.contents() if field is not None else None


def load_tokenizer(model_config: ModelConfig):
    """A transformers tokenizer for `model_config`, with a chat template set."""
    from transformers import AutoTokenizer

    local_dir = model_config.local_dir or model_config.model
    kwargs: dict = {"local_files_only": True}
    if model_config.gguf_file is not None:
        gguf = Path(model_config.gguf_file)
        local_dir, kwargs["gguf_file"] = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(local_dir, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"cannot load the tokenizer of {model_config.model!r}: {err}") from err
    if not getattr(tokenizer, "chat_template", None):
        template = _gguf_chat_template(model_config.gguf_file) if model_config.gguf_file else None
        if template is None:
            logger.warning("%s ships no chat template; using ChatML", model_config.model)
        tokenizer.chat_template = template or CHATML_TEMPLATE
    return tokenizer
