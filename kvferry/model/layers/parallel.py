"""Tensor-parallel group: rank, size, and the two collectives the layers need."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvferry.config import MoEParallel
from kvferry.errors import ConfigError

if TYPE_CHECKING:  # the head split (kv_head_range) serves the torch-free connector halves too
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group. Collectives are no-ops when size == 1."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None: the default group
    moe: MoEParallel = MoEParallel.TENSOR  # how the group splits routed experts (model.moe)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"bad tensor-parallel rank {self.rank} of size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group (in place when size > 1); returns the summed tensor."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim, in rank order."""
        if self.size == 1:
            return x
        import torch
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, columns, ...); it must divide evenly."""
        if total % self.size:
            raise ConfigError(f"{what} ({total}) is not divisible by tensor-parallel size {self.size}")
        return total // self.size

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        """This rank's query and KV heads; query heads follow the KV head they read.

        KV heads split into contiguous ranges, the first `num_kv_heads % size` ranks taking
        one more (3 KV heads over 2 ranks: 2 and 1). With fewer KV heads than ranks, each KV
        head is replicated on `size // num_kv_heads` ranks that split its query heads.
        """
        if num_heads % num_kv_heads:
            raise ConfigError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
        group = num_heads // num_kv_heads
        kv_start, kv_count = kv_head_range(self.rank, self.size, num_kv_heads)
        if num_kv_heads >= self.size:
            return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
        if self.size % num_kv_heads:
            raise ConfigError(
                f"tensor-parallel size {self.size} is not a multiple of the {num_kv_heads} KV heads"
            )
        q_count = self.split(num_heads, "number of attention heads")
        return HeadShard(self.rank * q_count, q_count, kv_start, kv_count)


def kv_head_range(rank: int, tp: int, total_heads: int) -> tuple[int, int]:
    """(first global KV head, count) TP rank `rank` holds: contiguous ranges, the first
    `total % tp` ranks taking one more; with fewer heads than ranks, each head replicated
    on `tp // total` consecutive ranks. (The NIXL connector reads remote ranks by it.)"""
    if total_heads >= tp:
        base, extra = divmod(total_heads, tp)
        return rank * base + min(rank, extra), base + (rank < extra)
    return rank * total_heads // tp, 1


@dataclass(frozen=True)
class HeadShard:
    """A rank's attention heads: contiguous query heads and the KV heads they attend."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int
