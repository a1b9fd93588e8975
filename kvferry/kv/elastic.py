"""Elastic KV memory on CPU: address space reserved, pages committed while blocks are in use.

Each KV tensor is a view over its own anonymous private mapping reserved with
MAP_NORESERVE: nothing is committed until written. The scheduler's block pool says which
pages hold blocks in use (kvferry.kv.pages.PageChanges, once per step); `apply` commits
newly used pages (MADV_POPULATE_WRITE, or one write per page where the kernel lacks it)
and returns freed ones to the kernel (MADV_DONTNEED: they read as zeros afterwards).

A page of block ids spans two ranges in every tensor: its blocks' K bytes and their V
bytes (the leading 2 of the NHD/HND layouts). Transparent huge pages are turned off for
the mappings, so one committed page is one page of the granularity.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvferry.errors import ConfigError
from kvferry.kv.pages import PageChanges, page_runs
from kvferry.kv.spec import KVCacheConfig, KVCacheSpec
from kvferry.kv.usage import KVMemoryUsage

logger = logging.getLogger(__name__)

MAP_NORESERVE = 0x4000  # Linux; not exported by Python's mmap module
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not exported by Python 3.11's mmap module


def page_granularity() -> int:
    """Bytes of the smallest page the CPU allocator maps or returns."""
    return mmap.PAGESIZE


@dataclass
class _Region:
    """One KV tensor's reserved mapping."""

    buffer: mmap.mmap
    tensor: torch.Tensor  # the KV tensor, a view over `buffer`
    half_bytes: int  # bytes of K (= of V) of one block
    capacity: int  # blocks the tensor has room for (the virtual capacity)

    def ranges(self, first_block: int, num_blocks: int) -> list[tuple[int, int]]:
        """(offset, length) of the K bytes and of the V bytes of a run of blocks."""
        num_blocks = min(num_blocks, self.capacity - first_block)
        length = num_blocks * self.half_bytes
        k_start = first_block * self.half_bytes
        return [(k_start, length), (self.capacity * self.half_bytes + k_start, length)]


class ElasticKVMemory:
    """The KV tensors of one rank over reserved address space, mapped page by page."""

    def __init__(self, config: KVCacheConfig):
        assert config.is_elastic and config.virtual_num_blocks % config.blocks_per_page == 0
        self.config = config
        self.blocks_per_page = config.blocks_per_page
        self.mapped: set[int] = set()
        self._unplanned: set[int] = set()  # mapped for a dummy step
        self._populate = True  # MADV_POPULATE_WRITE works (cleared on the first EINVAL)
        self.regions: list[_Region] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        for tensor_spec in config.tensors:
            spec = config.groups[config.group_of(tensor_spec.shared_by[0])].spec
            region = _reserve(config, tensor_spec.size_bytes, spec)
            self.regions.append(region)
            self.kv_caches.update(config.layer_views(tensor_spec, region.tensor))
        logger.info(
            "elastic KV memory: %d bytes reserved in %d mappings, pages of %d blocks",
            sum(t.size_bytes for t in config.tensors),
            len(self.regions),
            self.blocks_per_page,
        )

    @property
    def page_bytes(self) -> int:
        """Bytes one page of block ids commits, over every tensor (K and V)."""
        return sum(2 * r.half_bytes * self.blocks_per_page for r in self.regions)

    @property
    def mapped_bytes(self) -> int:
        """What the allocator's own accounting says is committed."""
        return len(self.mapped) * self.page_bytes

    def apply(self, changes: PageChanges | None) -> None:
        """Commit and return pages as the scheduler's block pool says (before a step)."""
        if changes is None or changes.is_empty:
            return
        if changes.full_sync:
            keep = set(changes.mapped)
            self._return(p for p in range(self.config.num_pages) if p not in keep)
        self._commit(p for p in changes.mapped if p not in self.mapped)
        self._return(changes.unmapped)

    def map_blocks(self, block_ids: Iterable[int]) -> None:
        """Map the pages of blocks a dummy step (warm-up) uses: blocks the pool never
        handed out (a write would commit them anyway; mapped first, they are accounted)."""
        pages = {b // self.blocks_per_page for b in block_ids} - self.mapped
        self._unplanned |= pages
        self._commit(pages)

    def return_unplanned(self) -> None:
        """Return the pages `map_blocks` mapped."""
        self._return(list(self._unplanned))
        self._unplanned.clear()

    def release(self) -> None:
        """Return every page (the tensors stay valid and read as zeros)."""
        self._return(range(self.config.num_pages))

    def usage(self) -> KVMemoryUsage:
        reserved = sum(len(r.buffer) for r in self.regions)
        return KVMemoryUsage(reserved, self.mapped_bytes, self.resident_bytes(), len(self.mapped))

    def resident_bytes(self) -> int:
        """Bytes of the mappings the kernel says are resident (mincore), all tensors."""
        return sum(_resident_bytes(r) for r in self.regions)

    def _commit(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        for first, count in page_runs(pages):
            for region in self.regions:
                for start, length in region.ranges(
                    first * self.blocks_per_page, count * self.blocks_per_page
                ):
                    self._populate_range(region, start, length)
        self.mapped.update(pages)

    def _return(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        for first, count in page_runs(pages):
            for region in self.regions:
                for start, length in region.ranges(
                    first * self.blocks_per_page, count * self.blocks_per_page
                ):
                    region.buffer.madvise(mmap.MADV_DONTNEED, start, length)
        self.mapped.difference_update(pages)

    def _populate_range(self, region: _Region, start: int, length: int) -> None:
        if self._populate:
            try:
                region.buffer.madvise(MADV_POPULATE_WRITE, start, length)
                return
            except OSError:
                logger.info("MADV_POPULATE_WRITE unavailable: pages are committed by a write")
                self._populate = False
        raw = torch.frombuffer(region.buffer, dtype=torch.uint8, count=length, offset=start)
        raw[:: mmap.PAGESIZE].add_(0)  # a write fault per page; the bytes stay as they are


def _reserve(config: KVCacheConfig, size_bytes: int, spec: KVCacheSpec) -> _Region:
    try:
        buffer = mmap.mmap(-1, size_bytes, flags=mmap.MAP_PRIVATE | MAP_NORESERVE)
    except OSError as exc:  # e.g. vm.overcommit_memory=2, which counts reserved space
        raise ConfigError(
            f"cannot reserve {size_bytes} bytes of address space for elastic KV memory ({exc}); "
            "use --kv-allocator eager or a smaller KV cache"
        ) from exc
    buffer.madvise(mmap.MADV_NOHUGEPAGE)
    shape = config.layout.shape(config.virtual_num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    tensor = torch.frombuffer(buffer, dtype=spec.dtype).view(shape)
    return _Region(buffer, tensor, spec.page_size_bytes // 2, config.virtual_num_blocks)


def _resident_bytes(region: _Region) -> int:
    length = len(region.buffer)
    num_pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * num_pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(region.tensor.data_ptr()), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed on the KV mapping")
    resident = torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1).sum().item()
    return int(resident) * mmap.PAGESIZE
