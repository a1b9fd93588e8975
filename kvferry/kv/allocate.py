"""Build the KVCacheConfig for a model and allocate its tensors (eager: zero-filled tensors;
elastic: reserved address space, kvferry.kv.elastic).

Groups come from the layers' specs, as the model states them (`AttentionLayerKV`):
layers with equal specs form a group. When specs differ (Gemma 3's sliding and full
layers), the allocation is hybrid: every group gets the same number of layers (a spec
with more layers is split into several groups), and tensor i is shared by layer i of
every group. One block id then means the same bytes in every group, and one block pool
hands ids out to all groups, so they never collide. A block holds `group_size` pages.

Groups whose pages differ in size (Gemma 4's full-attention layers: another head size and
KV head count) are padded to the largest page: each stored head of a smaller group is
widened with zeros (`KVCacheSpec.head_padding`), so every tensor, connector and the one
block pool still see one page size. The cost is the padding itself, at most the
difference between the largest page and the group's own in each block of a padded group.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import torch

from kvferry.errors import ConfigError
from kvferry.kv.elastic import page_granularity
from kvferry.kv.pages import blocks_per_page
from kvferry.kv.shared_pool import KVPoolSpec, pool_size_bytes
from kvferry.kv.spec import (
    AttentionLayerKV,
    KVAllocator,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    KVCacheTensor,
    LatentAttentionSpec,
    Layout,
)

logger = logging.getLogger(__name__)


# What the allocator reads of the engine's options (kvferry.config's ModelConfig and
# CacheConfig have these fields): stated here so kv/ sits below config.py (no package cycle).
class ModelDType(Protocol):
    @property
    def dtype(self) -> torch.dtype: ...


class CacheOptions(Protocol):
    @property
    def block_size(self) -> int: ...
    @property
    def kv_cache_bytes(self) -> int | None: ...
    @property
    def num_gpu_blocks_override(self) -> int | None: ...
    @property
    def layout(self) -> Layout: ...
    @property
    def kv_allocator(self) -> KVAllocator: ...
    @property
    def kv_memory_pool(self) -> KVPoolSpec | None: ...


def build_kv_cache_config(
    model_config: ModelDType,
    cache_config: CacheOptions,
    layers: Sequence[AttentionLayerKV],
    budget_bytes: int,
    num_ranks: int = 1,
    granularity: int | None = None,
) -> KVCacheConfig:
    """Groups and tensors for `layers` (this rank's heads; tensor parallelism may give ranks
    different counts), holding the blocks `budget_bytes` pays for (kvferry.kv.budget), or
    `num_gpu_blocks_override` blocks. The KV cache takes the checkpoint's dtype. On a shared
    KV memory pool (`num_ranks` ranks' pages each) the engine may grow to the whole pool
    unless a size or block count was asked for, and never beyond it. Elastic pages fill
    whole `granularity`-byte pages of the device (default: the CPU's)."""
    specs = {layer.name: _spec(layer, cache_config.block_size, model_config.dtype) for layer in layers}
    groups = pad_to_one_page_size(group_layers(specs))
    page_size = groups[0].spec.page_size_bytes
    group_size = len(groups[0].layer_names)
    num_blocks = cache_config.num_gpu_blocks_override or budget_bytes // (page_size * group_size)
    allocator = cache_config.kv_allocator
    granularity = granularity or page_granularity()
    per_page = blocks_per_page(groups, granularity) if allocator is KVAllocator.ELASTIC else 1
    pool_page_bytes = page_size * group_size * per_page * num_ranks
    if cache_config.kv_memory_pool is not None:
        num_blocks = _pool_blocks(
            cache_config, cache_config.kv_memory_pool, num_blocks, pool_page_bytes, per_page
        )
    if num_blocks < 2:
        raise ConfigError(f"KV cache budget of {budget_bytes} bytes holds fewer than 2 blocks")
    capacity = _capacity(int(num_blocks), per_page)
    tensors = tuple(
        KVCacheTensor(page_size * capacity, tuple(g.layer_names[i] for g in groups if i < len(g.layer_names)))
        for i in range(group_size)
    )
    config = KVCacheConfig(
        groups=groups,
        tensors=tensors,
        layout=Layout(cache_config.layout),
        num_blocks=int(num_blocks),
        virtual_num_blocks=capacity,
        allocator=allocator,
        blocks_per_page=per_page,
        memory_pool=cache_config.kv_memory_pool,
        pool_page_bytes=pool_page_bytes,
    )
    logger.info("KV cache: %s", describe(config))
    return config


def _pool_blocks(
    cache_config: CacheOptions, pool: KVPoolSpec, num_blocks: int, page_bytes: int, per_page: int
) -> int:
    """An engine on a shared pool: the whole pool by default (its pages are granted while it
    runs), what was asked for if less, never more than the pool's whole pages."""
    pool_blocks = pool_size_bytes(pool) // page_bytes * per_page
    asked = cache_config.kv_cache_bytes is not None or cache_config.num_gpu_blocks_override is not None
    if asked and num_blocks <= pool_blocks:
        return num_blocks
    logger.info("KV cache: %d blocks, all the shared pool holds", pool_blocks)
    return pool_blocks


def _capacity(num_blocks: int, per_page: int) -> int:
    """The virtual capacity: the budget's blocks in whole pages (the ids past num_blocks in
    the last page are reserved but never handed out)."""
    return -(-num_blocks // per_page) * per_page


def _spec(layer: AttentionLayerKV, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    if layer.num_kv_heads <= 0 or layer.head_size <= 0:
        raise ConfigError(
            f"layer {layer.name!r} states {layer.num_kv_heads} KV heads of size {layer.head_size}"
        )
    return layer.spec(block_size, dtype)


def group_layers(specs: dict[str, KVCacheSpec]) -> tuple[KVCacheGroup, ...]:
    """Layers with equal specs, in order of first appearance, split into groups of equal
    size: the smallest spec's layer count (the last group of a spec may hold fewer)."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    if not by_spec:
        raise ConfigError("the model states no attention layers")
    size = min(len(names) for names in by_spec.values())
    return tuple(
        KVCacheGroup(spec, tuple(names[start : start + size]))
        for spec, names in by_spec.items()
        for start in range(0, len(names), size)
    )


def pad_to_one_page_size(groups: tuple[KVCacheGroup, ...]) -> tuple[KVCacheGroup, ...]:
    """Groups with pages smaller than the largest get wider stored heads (zero padding) to
    fill it; refused when the largest page is no whole number of the group's head rows."""
    largest = max(g.spec.page_size_bytes for g in groups)
    return tuple(replace(g, spec=_padded(g.spec, largest)) for g in groups)


def _padded(spec: KVCacheSpec, page_bytes: int) -> KVCacheSpec:
    if spec.page_size_bytes == page_bytes:
        return spec
    per_head_value = 2 * spec.block_size * spec.num_kv_heads * spec.dtype.itemsize
    if page_bytes % per_head_value:
        raise ConfigError(
            f"KV cache groups with pages of {spec.page_size_bytes} and {page_bytes} bytes: "
            f"{spec.num_kv_heads} KV heads of size {spec.head_size} cannot be padded to fill "
            f"{page_bytes} bytes per block"
        )
    stored = page_bytes // per_head_value
    return replace(spec, head_size=stored, head_padding=spec.head_padding + stored - spec.head_size)


def describe(config: KVCacheConfig) -> str:
    """One line: blocks, groups (spec and layer count), tensors."""
    groups = ", ".join(f"{_spec_name(g.spec)} x{len(g.layer_names)}" for g in config.groups)
    line = f"{config.num_blocks} blocks of {config.block_size} tokens; groups: {groups}; {len(config.tensors)} tensors"
    line += f"; layout {config.layout.value}"
    if config.is_elastic:
        line += f"; elastic: {config.virtual_num_blocks} reserved, pages of {config.blocks_per_page} blocks"
    return line


def _spec_name(spec: KVCacheSpec) -> str:
    if isinstance(spec, LatentAttentionSpec):
        return f"latent ({spec.latent_size} per token)"
    name = f"window {spec.window}" if spec.window else "full"
    heads = f"{spec.num_kv_heads}x{spec.head_size - spec.head_padding}"
    return f"{name} ({heads}, padded to {spec.head_size})" if spec.head_padding else f"{name} ({heads})"


def with_num_blocks(config: KVCacheConfig, num_blocks: int) -> KVCacheConfig:
    """The same groups, specs and layout holding `num_blocks` blocks (eager: tensors resized).

    Tensor-parallel ranks agree on one block count (the smallest budget) while each keeps
    its own specs: their KV head counts may differ.
    """
    if num_blocks > config.num_blocks:
        raise ConfigError(f"{num_blocks} KV blocks exceed this rank's budget of {config.num_blocks}")
    capacity = _capacity(num_blocks, config.blocks_per_page)
    tensors = tuple(
        replace(t, size_bytes=t.size_bytes // config.virtual_num_blocks * capacity) for t in config.tensors
    )
    return replace(config, tensors=tensors, num_blocks=num_blocks, virtual_num_blocks=capacity)


def allocate_kv_caches(config: KVCacheConfig, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Zero-filled (hence pre-touched) tensors, one per KVCacheTensor, viewed per layer.

    Layers sharing a tensor (one of each group) see the same memory: their groups' block
    ids never collide."""
    caches: dict[str, torch.Tensor] = {}
    for tensor_spec in config.tensors:
        spec = config.groups[config.group_of(tensor_spec.shared_by[0])].spec
        tensor = torch.zeros(tensor_spec.size_bytes // spec.dtype.itemsize, dtype=spec.dtype, device=device)
        caches.update(config.layer_views(tensor_spec, tensor))
    return caches
