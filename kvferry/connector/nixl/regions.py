"""What a worker registers with NIXL and tells its peers, derived from KVCacheConfig.

Invariant 4: nothing here reads a tensor's shape. Sizes, block counts, head counts and
the layout come from KVCacheConfig; a tensor only contributes its base address, and
layers that share a tensor share one registered region.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import torch

from kvferry.config import ModelConfig
from kvferry.connector.nixl.protocol import GroupInfo, GroupKind, LayerRegion
from kvferry.kv.spec import KVCacheConfig, KVCacheSpec, SlidingWindowSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Region:
    """One distinct memory region (one KV tensor), registered once."""

    base: int
    size: int
    device_id: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_regions(
    kv_caches: dict[str, torch.Tensor], config: KVCacheConfig
) -> tuple[list[Region], list[LayerRegion]]:
    """Distinct regions to register, and every layer's place in them.

    One region per KVCacheTensor, deduplicated by base address; each member layer of a
    tensor gets a LayerRegion pointing at it.
    """
    regions: dict[int, Region] = {}
    layers: list[LayerRegion] = []
    for tensor_spec in config.tensors:
        tensor = kv_caches[tensor_spec.shared_by[0]]
        spec = config.groups[config.group_of(tensor_spec.shared_by[0])].spec
        base = tensor.data_ptr()
        device_id = max(tensor.get_device(), 0)
        known = regions.get(base)
        if known is None:
            regions[base] = Region(base, tensor_spec.size_bytes, device_id)
        elif known.size != tensor_spec.size_bytes:
            raise ValueError(f"KV tensors at {base:#x} disagree on their size")
        capacity = tensor_spec.size_bytes // spec.page_size_bytes
        if capacity < config.num_blocks:
            raise ValueError(
                f"KV tensor of {tensor_spec.shared_by} holds {capacity} < {config.num_blocks} blocks"
            )
        for name in tensor_spec.shared_by:
            if kv_caches[name].data_ptr() != base:
                raise ValueError(f"layer {name} is not backed by its KVCacheTensor")
            layers.append(LayerRegion(name, base, capacity))
    logger.info("NIXL regions: %d distinct for %d layers", len(regions), len(layers))
    return list(regions.values()), layers


def group_infos(config: KVCacheConfig) -> list[GroupInfo]:
    return [
        GroupInfo(
            kind=GroupKind.SLIDING if isinstance(g.spec, SlidingWindowSpec) else GroupKind.FULL,
            block_size=g.spec.block_size,
            kv_heads=g.spec.num_kv_heads,
            head_size=g.spec.head_size,
            dtype=dtype_name(g.spec.dtype),
            sliding_window=g.spec.window,
            layer_names=list(g.layer_names),
        )
        for g in config.groups
    ]


def compat_hash(model: ModelConfig, config: KVCacheConfig) -> str:
    """What must match for one engine's KV blocks to mean the same in another."""
    groups = [
        {
            "kind": g.kind.value,
            "head_size": g.head_size,
            "dtype": g.dtype,
            "window": g.sliding_window,
            "layers": g.layer_names,
        }
        for g in group_infos(config)
    ]
    doc = {
        "architecture": model.architecture,
        "layers": model.num_layers,
        "hidden": model.hidden_size,
        "vocab": model.vocab_size,
        "kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "dtype": dtype_name(model.dtype),
        "groups": groups,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def token_hash(token_ids: list[int]) -> str:
    """Fingerprint of the tokens whose KV a prefill holds (checked by the decoder)."""
    data = b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids)
    return hashlib.sha256(data).hexdigest()[:32]


def block_bytes(spec: KVCacheSpec) -> int:
    """Bytes of K (or V) of one block of one layer on one rank."""
    return spec.page_size_bytes // 2
