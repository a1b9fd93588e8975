"""Weight loading: build the model class for a ModelConfig and fill it from its checkpoint."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from kvferry.config import ModelConfig, WeightQuantization
from kvferry.cpu_features import native_half_precision
from kvferry.errors import ConfigError
from kvferry.model.causal_lm import CausalLM
from kvferry.model.layers import cpu_kernels
from kvferry.model.layers.attention import PagedAttention
from kvferry.model.layers.gguf_kernel import GGUFBlocks
from kvferry.model.layers.gguf_linear import GGUFWeight
from kvferry.model.layers.int4 import Int4Weight
from kvferry.model.layers.kernel_choice import describe_cpu_kernels, kernel_sources
from kvferry.model.layers.linear import PackableLinear
from kvferry.model.layers.mla import set_mla_forms
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.loader.gguf_blocks import kept_gguf_blocks
from kvferry.model.loader.gguf_weights import gguf_state_dict, iter_gguf_weights
from kvferry.model.loader.safetensors import safetensors_weights
from kvferry.model.registry import model_class

logger = logging.getLogger(__name__)

__all__ = ["gguf_state_dict", "load_model"]


def load_model(
    model_config: ModelConfig,
    tp: TPGroup | None = None,
    device: str | torch.device = "cpu",
) -> CausalLM:
    """Instantiate `model_config.architecture` on `device` and load its weights.

    Weights take `model_config.dtype`; the model computes in `compute_dtype` (float32 for
    half precision on a CPU without native half-precision GEMMs, the weights rounded to
    the requested dtype first). float32 CPU linear weights are pre-packed for oneDNN (see
    layers.packed).
    """
    tp = tp or TPGroup()
    start = time.perf_counter()
    quantization = model_config.quantization
    if quantization is not WeightQuantization.NONE and torch.device(device).type != "cpu":
        raise ConfigError(
            f"--quantization {quantization} runs on CPU only (its kernel is the CPU's), not on {device}"
        )
    if quantization is WeightQuantization.GGUF and model_config.gguf_file is None:
        raise ConfigError(
            "--quantization gguf keeps a GGUF checkpoint's blocks: the model must be a .gguf file"
        )
    dtype = compute_dtype(model_config.dtype, device)
    if torch.device(device).type == "cpu":  # compiled while the weights load, side by side
        cpu_kernels.build_ahead(kernel_sources(quantization, dtype))
    cls = model_class(model_config.architecture)
    with torch.device(device):
        model = cls(model_config.hf_config, tp=tp, dtype=dtype)
    if model_config.gguf_file is not None:
        weights = iter_gguf_weights(model_config.gguf_file)
    else:
        weights = safetensors_weights(model_config.local_dir or model_config.model)
    if dtype != model_config.dtype:
        logger.info(
            "%s weights computed in %s on this CPU (no native %s GEMM)",
            model_config.dtype,
            dtype,
            model_config.dtype,
        )
        weights = ((name, tensor.to(model_config.dtype).to(dtype)) for name, tensor in weights)
    model.load_weights(weights)
    model.eval()
    kept = {}
    if quantization is WeightQuantization.GGUF and model_config.gguf_file is not None:
        kept = kept_gguf_blocks(model_config.gguf_file, model, tp.size)
    pack_linear_weights(model, quantization, kept)
    if torch.device(device).type == "cpu":
        fused = model.fuse_decode_layers()
        logger.info("%d decoder layers decode in one operator call (fused layer)", fused)
    set_mla_forms(model, model_config.mla_forms)
    threads = torch.get_num_threads()
    if (
        torch.device(device).type == "cpu"
        and tp.size == 1
        and threads > 1
        and hasattr(model, "enable_microbatching")
    ):
        model.enable_microbatching(threads)  # see kvferry.model.microbatch
    if torch.device(device).type == "cpu":
        head_dims = {m.head_dim for m in model.modules() if isinstance(m, PagedAttention)}
        logger.info("CPU kernels: %s", describe_cpu_kernels(dtype, head_dims, model_config.quantization))
    logger.info(
        "loaded %s (tp rank %d/%d) in %.1fs",
        model_config.model,
        tp.rank,
        tp.size,
        time.perf_counter() - start,
    )
    return model


def compute_dtype(dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """The dtype a model with `dtype` weights computes in on `device`: half precision
    computes in float32 on a CPU without native half-precision GEMMs (far slower there,
    kvferry.cpu_features); the KV cache keeps the requested dtype."""
    if torch.device(device).type != "cpu" or dtype == torch.float32:
        return dtype
    return dtype if native_half_precision(dtype) else torch.float32


def pack_linear_weights(
    model: nn.Module,
    quantization: WeightQuantization = WeightQuantization.NONE,
    kept: dict[str, GGUFBlocks] | None = None,
) -> int:
    """Pack every packable linear weight of a loaded model (as int4, or as the GGUF blocks
    `kept` by parameter name, where asked and possible); returns how many were packed."""
    by_tensor = {id(p): kept[n] for n, p in model.named_parameters() if kept and n in kept}
    linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
    count = sum(m.pack_weight(quantization=quantization, blocks=by_tensor.get(id(m.weight))) for m in linears)
    int4 = sum(isinstance(m.packed, Int4Weight) for m in linears)
    blocks = sum(isinstance(m.packed, GGUFWeight) for m in linears)
    if count:
        logger.info(
            "packed %d linear weights (%d as weight-only int4, %d as GGUF blocks) for the CPU GEMM",
            count,
            int4,
            blocks,
        )
    return count
