"""Architecture name -> model class. Classes import lazily so config code stays light."""

from __future__ import annotations

import importlib
import logging
from types import MappingProxyType
from typing import TYPE_CHECKING

from kvferry.errors import ModelLoadError

if TYPE_CHECKING:
    from kvferry.model.causal_lm import CausalLM

logger = logging.getLogger(__name__)

# architecture name (HF `architectures[0]`) -> (module, class name)
ARCHITECTURES = MappingProxyType(
    {
        "LlamaForCausalLM": ("kvferry.model.llama", "LlamaForCausalLM"),
        "Qwen2ForCausalLM": ("kvferry.model.llama", "Qwen2ForCausalLM"),
        "Qwen3ForCausalLM": ("kvferry.model.llama", "Qwen3ForCausalLM"),
        "MistralForCausalLM": ("kvferry.model.llama", "MistralForCausalLM"),
        "Qwen3MoeForCausalLM": ("kvferry.model.qwen3_moe", "Qwen3MoeForCausalLM"),
        "DeepseekV2ForCausalLM": ("kvferry.model.deepseek", "DeepseekV2ForCausalLM"),
        "DeepseekV3ForCausalLM": ("kvferry.model.deepseek", "DeepseekV3ForCausalLM"),
        "Gemma3ForCausalLM": ("kvferry.model.gemma3", "Gemma3ForCausalLM"),
        "Gemma3ForConditionalGeneration": ("kvferry.model.gemma3", "Gemma3ForConditionalGeneration"),
        "Gemma4ForCausalLM": ("kvferry.model.gemma4", "Gemma4ForCausalLM"),
        "Gemma4ForConditionalGeneration": ("kvferry.model.gemma4", "Gemma4ForConditionalGeneration"),
    }
)

# HF `model_type` -> architecture name, for configs that do not list `architectures`
MODEL_TYPES = MappingProxyType(
    {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "deepseek_v2": "DeepseekV2ForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
        "gemma3": "Gemma3ForConditionalGeneration",
        "gemma4_text": "Gemma4ForCausalLM",
        "gemma4": "Gemma4ForConditionalGeneration",
    }
)


def is_supported(architecture: str) -> bool:
    return architecture in ARCHITECTURES


def check_supported(architecture: str, model: str) -> None:
    if not is_supported(architecture):
        raise ModelLoadError(
            f"model {model!r} has architecture {architecture!r}, which kvferry does not support; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )


def model_class(architecture: str) -> type[CausalLM]:
    """The CausalLM class implementing `architecture`."""
    from kvferry.model.causal_lm import CausalLM  # with the architecture's module: torch

    check_supported(architecture, architecture)
    module_name, class_name = ARCHITECTURES[architecture]
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, CausalLM)):
        raise ModelLoadError(f"{module_name}.{class_name} is not a causal LM class")
    return cls
