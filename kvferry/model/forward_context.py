"""Per-forward context passed explicitly through the model (no module globals).

The model runner builds one ForwardContext per forward. Tokens are ordered decodes
first (one query token each), then prefill spans (chunks of prompts, or prompts with a
prefix hit), each span contiguous.

The context is an opaque reference object for torch.compile: a captured graph takes it
as an input and hands it, untouched, to the operators that need it (attention, connector
hooks), so every execution of the graph reads the context of its own step.
"""

from __future__ import annotations

import enum
import math
import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

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
    num_decodes: int  # the first num_decodes tokens are decodes (one query each)
    decode_block_table: torch.Tensor  # int64 [num_decodes, max_blocks], padded with 0
    decode_seq_lens: torch.Tensor  # int64 [num_decodes]: tokens visible incl. the new one
    prefills: list[PrefillSpan] = field(default_factory=list)
    block_size: int = 16
    # int64 [num_decodes]: position of each decode table's first key. Set for sliding-window
    # groups, whose decode tables start at the first block the window sees; None: 0.
    decode_start_pos: torch.Tensor | None = None
    # Index of each request's first decode row, where a request has several (a token and
    # its drafts, kvferry.spec_decode: a later row reads the KV an earlier one writes, so a
    # batch is never cut between them); None: one row per request.
    decode_request_starts: tuple[int, ...] | None = None
    # Whether a request's rows are both decode rows and a prefill span (a preempted request
    # recomputed: its generated rows read the KV its prompt rows write this step), so the
    # batch is never cut into parts (kvferry.model.microbatch).
    split_requests: bool = False
    # The decode mask per (window, keys): built by the step's first layer of that window,
    # read by the others (kvferry.model.layers.attention). Lives and dies with the step.
    decode_masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


class LayerKVHooks(Protocol):
    """Per-layer connector hooks (the worker half of a KV connector)."""

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor, attn: AttentionMetadata) -> None: ...


class HookPlacement(enum.Enum):
    """How an attention layer calls the connector's per-layer hooks (invariant 2)."""

    NONE = "none"  # no connector, or one whose per-layer hooks do nothing: no call at all
    IN_GRAPH = "in_graph"  # graph-safe connector: custom operators inside the captured graph
    SPLIT = "split"  # not graph-safe: called eagerly, the captured graph is split at each call


class Workspace:
    """Grow-only scratch memory shared by the attention layers of one model runner.

    Gathering KV into freshly allocated memory costs page faults several times the copy
    itself on CPU; the layers run one after another, so one buffer serves them all. Each
    thread has its own buffer (micro-batch threads run forwards side by side).
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._local.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype).view(shape)


@dataclass
class ForwardContext(OpaqueBase):
    attn: tuple[AttentionMetadata, ...]  # one per KV cache group
    layer_group: dict[str, int]  # layer name -> KV cache group index
    kv_caches: dict[str, torch.Tensor]  # layer name -> its KV tensor (see Layout)
    layout: Layout = Layout.NHD
    kv_hooks: LayerKVHooks | None = None
    workspace: Workspace | None = None  # scratch for gathered KV (None: fresh memory)

    def attn_for(self, layer_name: str) -> AttentionMetadata:
        return self.attn[self.layer_group[layer_name]]

    def __reduce__(self) -> tuple[type, tuple[str]]:
        """What the compiler's cache key sees: a graph input of this type, not its contents
        (pickling the KV caches it refers to would copy gigabytes on every compile)."""
        return str, (type(self).__qualname__,)


register_opaque_type(ForwardContext, typ="reference")
