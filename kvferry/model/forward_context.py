"""Per-forward context passed explicitly through the model (no module globals).

The model runner builds one ForwardContext per forward. Tokens are ordered decodes
first (one query token each), then prefill spans (chunks of prompts, or prompts with a
prefix hit), each span contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvferry.kv.spec import Layout


@dataclass
class PrefillSpan:
    query_start: int  # index of its first token in the flat batch
    query_len: int
    context_len: int  # tokens already in the cache before this span
    block_table: torch.Tensor  # int64 [num_blocks] covering context_len + query_len tokens


@dataclass
class AttentionMetadata:
    """Attention inputs for one KV cache group."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    num_decodes: int  # the first num_decodes tokens are decodes, one per request
    decode_block_table: torch.Tensor  # int64 [num_decodes, max_blocks], padded with 0
    decode_seq_lens: torch.Tensor  # int64 [num_decodes]: tokens visible incl. the new one
    prefills: list[PrefillSpan] = field(default_factory=list)
    block_size: int = 16


class LayerKVHooks(Protocol):
    """Per-layer connector hooks (the worker half of a KV connector)."""

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor, attn: AttentionMetadata) -> None: ...


@dataclass
class ForwardContext:
    attn: tuple[AttentionMetadata, ...]  # one per KV cache group
    layer_group: dict[str, int]  # layer name -> KV cache group index
    kv_caches: dict[str, torch.Tensor]  # layer name -> its KV tensor (see Layout)
    layout: Layout = Layout.NHD
    kv_hooks: LayerKVHooks | None = None

    def attn_for(self, layer_name: str) -> AttentionMetadata:
        return self.attn[self.layer_group[layer_name]]
