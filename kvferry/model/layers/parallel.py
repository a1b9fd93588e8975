"""Tensor-parallel group: rank, size, and the two collectives the layers need."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvferry.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group. Collectives are no-ops when size == 1."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None: the default group

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

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads on this rank). Heads are replicated when fewer than ranks."""
        if num_kv_heads >= self.size:
            per_rank = self.split(num_kv_heads, "number of KV heads")
            return self.rank * per_rank, per_rank
        if self.size % num_kv_heads:
            raise ConfigError(
                f"tensor-parallel size {self.size} is not a multiple of the {num_kv_heads} KV heads"
            )
        return self.rank * num_kv_heads // self.size, 1
