"""The KV allocators behind one interface: the worker binds `kv_caches` and, before each
step, passes the scheduler's page changes to `apply`.

Eager: tensors committed (zero-filled) at start-up; page changes never come. Elastic
(kvferry.kv.elastic): address space reserved, pages committed and returned as blocks are
used and freed, on CPU (kvferry.kv.elastic: mmap + madvise) or CUDA
(kvferry.kv.elastic_cuda: the driver's virtual memory management).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from kvferry.errors import ConfigError
from kvferry.kv.allocate import allocate_kv_caches
from kvferry.kv.elastic import ElasticKVMemory
from kvferry.kv.elastic import page_granularity as cpu_page_granularity
from kvferry.kv.elastic_cuda import CudaElasticKVMemory, cuda_page_granularity
from kvferry.kv.pages import PageChanges
from kvferry.kv.spec import KVCacheConfig
from kvferry.kv.usage import KVMemoryUsage


class KVMemory(Protocol):
    """One rank's KV tensors and the memory under them."""

    kv_caches: dict[str, torch.Tensor]

    def apply(self, changes: PageChanges | None) -> None:
        """Map and return pages as the scheduler's block pool says, before a step."""

    def usage(self) -> KVMemoryUsage:
        """What is reserved and committed now."""

    def map_blocks(self, block_ids: Iterable[int]) -> None:
        """Map the pages of blocks a step the pool did not plan (a dummy step) uses."""

    def return_unplanned(self) -> None:
        """Return the pages `map_blocks` mapped."""

    def release(self) -> None:
        """Return what can be returned (shutdown)."""


class EagerKVMemory:
    """Every byte committed at start-up."""

    def __init__(self, config: KVCacheConfig, device: torch.device | str):
        self.kv_caches = allocate_kv_caches(config, device)
        self._bytes = sum(t.size_bytes for t in config.tensors)

    def apply(self, changes: PageChanges | None) -> None:
        assert changes is None or changes.is_empty, "page changes for eager KV memory"

    def usage(self) -> KVMemoryUsage:
        return KVMemoryUsage(self._bytes, self._bytes, self._bytes, 0)

    def map_blocks(self, block_ids: Iterable[int]) -> None:
        """Eager memory is all mapped."""

    def return_unplanned(self) -> None:
        """Eager memory is all planned."""

    def release(self) -> None:
        """Eager memory goes with its tensors."""


def allocate_kv_memory(config: KVCacheConfig, device: torch.device | str) -> KVMemory:
    """The allocator `config.allocator` names, with its tensors allocated."""
    if not config.is_elastic:
        return EagerKVMemory(config, device)
    device = torch.device(device)
    if device.type == "cuda":
        return CudaElasticKVMemory(config, device)
    if device.type != "cpu":
        raise ConfigError(f"--kv-allocator elastic works on CPU and CUDA memory, not {device}")
    return ElasticKVMemory(config)


def page_granularity(device: torch.device | str) -> int:
    """Bytes of the smallest page elastic memory maps on `device`."""
    device = torch.device(device)
    return cuda_page_granularity(device) if device.type == "cuda" else cpu_page_granularity()
