"""Weight loading: build the model class for a ModelConfig and fill it from its checkpoint."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from kvferry.config import ModelConfig
from kvferry.model.layers.linear import PackableLinear
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.loader.gguf_weights import gguf_state_dict, iter_gguf_weights
from kvferry.model.loader.safetensors import safetensors_weights
from kvferry.model.registry import model_class

logger = logging.getLogger(__name__)

__all__ = ["gguf_state_dict", "load_model"]


def load_model(
    model_config: ModelConfig,
    tp: TPGroup | None = None,
    device: str | torch.device = "cpu",
    pack_weights: bool = True,
) -> nn.Module:
    """Instantiate `model_config.architecture` on `device` in `model_config.dtype` and load weights.

    `pack_weights`: pre-pack float32 CPU linear weights for oneDNN (see layers.packed).
    """
    tp = tp or TPGroup()
    start = time.perf_counter()
    cls = model_class(model_config.architecture)
    dtype = model_config.dtype
    with torch.device(device):
        model = cls(model_config.hf_config, tp=tp, dtype=dtype)
    if model_config.gguf_file is not None:
        weights = iter_gguf_weights(model_config.gguf_file)
    else:
        weights = safetensors_weights(model_config.local_dir or model_config.model)
    model.load_weights(weights)
    model.eval()
    if pack_weights:
        pack_linear_weights(model)
    logger.info(
        "loaded %s (tp rank %d/%d) in %.1fs",
        model_config.model,
        tp.rank,
        tp.size,
        time.perf_counter() - start,
    )
    return model


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every packable linear weight of a loaded model; returns how many were packed."""
    count = sum(m.pack_weight() for m in model.modules() if isinstance(m, PackableLinear))
    if count:
        logger.info("packed %d linear weights for the CPU GEMM", count)
    return count
