"""Typed description of the KV cache, shared by the scheduler, the worker and connectors.

Nothing downstream reads tensor shapes to learn block sizes or layouts: it reads these.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from kvferry.kv.shared_pool import KVPoolSpec

if TYPE_CHECKING:  # torch only types dtypes and tensors here: the config layer stays torch-free
    import torch


class Layout(str, Enum):
    """Per-layer tensor layout. The leading 2 indexes K (0) and V (1)."""

    NHD = "NHD"  # [2, num_blocks, block_size, kv_heads, head_dim]
    HND = "HND"  # [2, num_blocks, kv_heads, block_size, head_dim]

    def shape(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        if self is Layout.NHD:
            return (2, num_blocks, block_size, kv_heads, head_dim)
        return (2, num_blocks, kv_heads, block_size, head_dim)


class KVAllocator(str, Enum):
    """How the KV tensors get memory (--kv-allocator)."""

    EAGER = "eager"  # the whole budget committed at start-up
    ELASTIC = "elastic"  # capacity reserved; pages committed while their blocks are in use

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's blocks. `head_size` is what the tensor stores per head: groups whose
    pages are smaller than the largest are padded to it (kvferry.kv.allocate), the last
    `head_padding` values of each stored head being zeros the layer never reads."""

    block_size: int
    num_kv_heads: int  # per rank
    head_size: int
    dtype: torch.dtype
    head_padding: int = 0

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block takes in one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    def max_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def window(self) -> int:
        """The sliding window in positions; 0: full attention."""
        return 0


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    pass


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    sliding_window: int = 0

    @property
    def window(self) -> int:
        return self.sliding_window


@dataclass(frozen=True)
class LatentAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek's MLA): per token one row of `latent_size`
    values (the compressed KV, then the rotary key part), shared by every query head and
    the same on every tensor-parallel rank. Its blocks are managed as full attention's
    (every position kept).

    The row is stored as one KV head whose K and V planes hold its two halves
    (`head_size` = ceil(latent_size / 2)): every layout, page computation and connector
    that moves [2, blocks, ...] tensors moves it unchanged, and a block's bytes are the
    row's bytes (plus one value when latent_size is odd)."""

    latent_size: int = 0


def latent_head_size(latent_size: int) -> int:
    """The head size a latent row of `latent_size` values is stored in (half of it, rounded up)."""
    return -(-latent_size // 2)


@dataclass(frozen=True)
class AttentionLayerKV:
    """What one attention layer keeps in the KV cache, as its model states it.

    `num_kv_heads` is this tensor-parallel rank's share; `sliding_window` None is full
    attention; `latent_size` > 0 is a latent-attention layer (one KV head of
    `latent_head_size(latent_size)`). The allocator turns it into the layer's KVCacheSpec.
    """

    name: str
    num_kv_heads: int
    head_size: int
    sliding_window: int | None = None
    latent_size: int = 0

    def spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        if self.latent_size:
            assert self.num_kv_heads == 1 and self.head_size == latent_head_size(self.latent_size)
            return LatentAttentionSpec(block_size, 1, self.head_size, dtype, latent_size=self.latent_size)
        if self.sliding_window is None:
            return FullAttentionSpec(block_size, self.num_kv_heads, self.head_size, dtype)
        return SlidingWindowSpec(
            block_size, self.num_kv_heads, self.head_size, dtype, sliding_window=self.sliding_window
        )


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers with equal specs; a request holds one block table per group."""

    spec: KVCacheSpec
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheTensor:
    """One allocated tensor and the layers that share it (KV sharing, hybrid allocation).

    Hybrid allocation: the sharing layers belong to different groups; block ids come from
    one pool, so each block of the tensor holds the KV of exactly one of them at a time.
    """

    size_bytes: int
    shared_by: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    groups: tuple[KVCacheGroup, ...]
    tensors: tuple[KVCacheTensor, ...]
    layout: Layout
    num_blocks: int  # physical block budget the scheduler may hand out
    virtual_num_blocks: int  # capacity reserved in address space (== num_blocks when eager)
    allocator: KVAllocator = KVAllocator.EAGER
    # Block ids [p * blocks_per_page, (p + 1) * blocks_per_page) share physical page p: in
    # every tensor, their K bytes and their V bytes each fill whole pages of the allocator.
    # Pages are mapped and returned as a whole (kvferry.kv.pages).
    blocks_per_page: int = 1
    # A KV memory pool shared with other engines (--kv-memory-pool), and what one page of
    # block ids commits on all tensor-parallel ranks together (the pool counts bytes).
    memory_pool: KVPoolSpec | None = None
    pool_page_bytes: int = 0

    @property
    def num_pages(self) -> int:
        """Pages of the virtual capacity (the last one may hold ids past num_blocks)."""
        return -(-self.virtual_num_blocks // self.blocks_per_page)

    @property
    def is_elastic(self) -> bool:
        return self.allocator is KVAllocator.ELASTIC

    def group_of(self, layer_name: str) -> int:
        for gid, group in enumerate(self.groups):
            if layer_name in group.layer_names:
                return gid
        raise KeyError(f"layer {layer_name!r} belongs to no KV cache group")

    @property
    def has_sliding_window(self) -> bool:
        """Whether a group clips to a window (kvferry.kv.null_block: the null block is then kept aside)."""
        return any(isinstance(g.spec, SlidingWindowSpec) for g in self.groups)

    @property
    def block_size(self) -> int:
        sizes = {g.spec.block_size for g in self.groups}
        assert len(sizes) == 1, "all groups share one block size"
        return sizes.pop()

    def layer_shape(self, layer_name: str) -> tuple[int, ...]:
        """The shape of `layer_name`'s view of its tensor (its group's spec, the layout)."""
        spec = self.groups[self.group_of(layer_name)].spec
        return self.layout.shape(self.virtual_num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)

    def layer_views(self, tensor_spec: KVCacheTensor, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each sharing layer's view of one allocated tensor, in its own shape: the pages are
        equal, the groups' KV heads and head sizes may differ (Gemma 4's full layers)."""
        assert tensor.is_contiguous() and tensor.numel() * tensor.element_size() == tensor_spec.size_bytes
        return {name: tensor.view(self.layer_shape(name)) for name in tensor_spec.shared_by}
