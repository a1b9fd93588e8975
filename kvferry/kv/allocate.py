"""Build the KVCacheConfig for a model and allocate its tensors (eager allocator)."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from kvferry.config import CacheConfig, ModelConfig
from kvferry.errors import ConfigError
from kvferry.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, KVCacheTensor, Layout

logger = logging.getLogger(__name__)


def build_kv_cache_config(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    layer_names: list[str],
    num_kv_heads: int | None,
    budget_bytes: int,
) -> KVCacheConfig:
    """One full-attention group over all layers, one tensor per layer, holding the blocks
    `budget_bytes` pays for (kvferry.kv.budget), or `num_gpu_blocks_override` blocks.

    `num_kv_heads` is this rank's share (tensor parallelism may give ranks different
    counts); the model's total when None.
    """
    num_kv_heads = model_config.num_kv_heads if num_kv_heads is None else num_kv_heads
    if not 0 < num_kv_heads <= model_config.num_kv_heads:
        raise ConfigError(f"{num_kv_heads} KV heads per rank for a model with {model_config.num_kv_heads}")
    spec = FullAttentionSpec(
        block_size=cache_config.block_size,
        num_kv_heads=num_kv_heads,
        head_size=model_config.head_dim,
        dtype=model_config.dtype,
    )
    num_blocks = cache_config.num_gpu_blocks_override or budget_bytes // (
        spec.page_size_bytes * len(layer_names)
    )
    if num_blocks < 2:
        raise ConfigError(f"KV cache budget of {budget_bytes} bytes holds fewer than 2 blocks")
    tensors = tuple(KVCacheTensor(spec.page_size_bytes * num_blocks, (name,)) for name in layer_names)
    return KVCacheConfig(
        groups=(KVCacheGroup(spec, tuple(layer_names)),),
        tensors=tensors,
        layout=Layout(cache_config.layout),
        num_blocks=int(num_blocks),
        virtual_num_blocks=int(num_blocks),
    )


def with_num_blocks(config: KVCacheConfig, num_blocks: int) -> KVCacheConfig:
    """The same groups, specs and layout holding `num_blocks` blocks (eager: tensors resized).

    Tensor-parallel ranks agree on one block count (the smallest budget) while each keeps
    its own specs: their KV head counts may differ.
    """
    if num_blocks > config.num_blocks:
        raise ConfigError(f"{num_blocks} KV blocks exceed this rank's budget of {config.num_blocks}")
    tensors = tuple(
        replace(t, size_bytes=t.size_bytes // config.num_blocks * num_blocks) for t in config.tensors
    )
    return replace(config, tensors=tensors, num_blocks=num_blocks, virtual_num_blocks=num_blocks)


def allocate_kv_caches(config: KVCacheConfig, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Zero-filled (hence pre-touched) tensors, one per KVCacheTensor, viewed per layer."""
    caches: dict[str, torch.Tensor] = {}
    for tensor_spec in config.tensors:
        spec = config.groups[config.group_of(tensor_spec.shared_by[0])].spec
        shape = config.layout.shape(config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        tensor = torch.zeros(shape, dtype=spec.dtype, device=device)
        assert tensor.numel() * tensor.element_size() == tensor_spec.size_bytes
        for layer_name in tensor_spec.shared_by:
            caches[layer_name] = tensor
    return caches
