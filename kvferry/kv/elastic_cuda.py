"""Elastic KV memory on CUDA: the driver's virtual memory management behind `KVMemory`.

Each KV tensor reserves a virtual address range (cuMemAddressReserve) and is wrapped as a
torch tensor without memory of its own (__cuda_array_interface__). A page of block ids
maps, in every tensor, one physical allocation for its blocks' K bytes and one for their V
bytes (cuMemCreate + cuMemMap + cuMemSetAccess), zero-filled as eager memory is; returning
the page unmaps and releases them (cuMemUnmap + cuMemRelease). Pages are as large as the
device's allocation granularity (2 MiB on current GPUs): `blocks_per_page` is computed
from it. The driver is reached through ctypes (libcuda), no extra dependency.

Not run in CI (no GPU there): tests/test_elastic_cuda.py skips without one.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvferry.kv.pages import PageChanges, page_runs
from kvferry.kv.spec import KVCacheConfig
from kvferry.kv.usage import KVMemoryUsage

logger = logging.getLogger(__name__)

_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_GRANULARITY_MINIMUM = 0  # CU_MEM_ALLOC_GRANULARITY_MINIMUM
_PROT_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaDriver:
    """The few driver calls elastic memory needs; every failure raises with its name."""

    def __init__(self, device: torch.device):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_device(self.device_index)
        torch.empty(1, device=device)  # the primary context is current from here on
        self.prop = _AllocationProp(
            type=_ALLOCATION_PINNED, location=_Location(_LOCATION_DEVICE, self.device_index)
        )
        self.access = _AccessDesc(_Location(_LOCATION_DEVICE, self.device_index), _PROT_READWRITE)

    def granularity(self) -> int:
        size = ctypes.c_size_t()
        flag = _GRANULARITY_MINIMUM
        _check(
            "cuMemGetAllocationGranularity",
            self.lib.cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(self.prop), flag),
        )
        return size.value

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_ulonglong()
        _check(
            "cuMemAddressReserve",
            self.lib.cuMemAddressReserve(
                ctypes.byref(ptr),
                ctypes.c_size_t(size),
                ctypes.c_size_t(0),
                ctypes.c_ulonglong(0),
                ctypes.c_ulonglong(0),
            ),
        )
        return ptr.value

    def map(self, ptr: int, size: int) -> int:
        """Back [ptr, ptr + size) with new physical memory; returns its handle."""
        handle = ctypes.c_ulonglong()
        length = ctypes.c_size_t(size)
        no_flags = ctypes.c_ulonglong(0)
        _check(
            "cuMemCreate",
            self.lib.cuMemCreate(ctypes.byref(handle), length, ctypes.byref(self.prop), no_flags),
        )
        address = ctypes.c_ulonglong(ptr)
        _check("cuMemMap", self.lib.cuMemMap(address, length, ctypes.c_size_t(0), handle, no_flags))
        _check(
            "cuMemSetAccess",
            self.lib.cuMemSetAccess(address, length, ctypes.byref(self.access), ctypes.c_size_t(1)),
        )
        return handle.value

    def unmap(self, ptr: int, size: int, handle: int) -> None:
        _check("cuMemUnmap", self.lib.cuMemUnmap(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size)))
        _check("cuMemRelease", self.lib.cuMemRelease(ctypes.c_ulonglong(handle)))

    def free(self, ptr: int, size: int) -> None:
        _check("cuMemAddressFree", self.lib.cuMemAddressFree(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size)))


def _check(call: str, result: int) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {result}")


def cuda_page_granularity(device: torch.device) -> int:
    """Bytes of the smallest physical allocation the device maps."""
    return CudaDriver(device).granularity()


class _ArrayInterface:
    """Bytes at a device address, for torch.as_tensor (no copy, no memory of its own)."""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


@dataclass
class _Region:
    ptr: int
    size: int  # reserved, a multiple of the granularity
    half_bytes: int
    capacity: int
    tensor: torch.Tensor
    handles: dict[tuple[int, int], int] = field(default_factory=dict)  # (page, K=0/V=1) -> handle

    def range(self, page: int, half: int, blocks_per_page: int) -> tuple[int, int]:
        """(address, bytes) of the K (half 0) or V (half 1) bytes of a page's blocks."""
        length = blocks_per_page * self.half_bytes
        return self.ptr + half * self.capacity * self.half_bytes + page * length, length


class CudaElasticKVMemory:
    """One rank's KV tensors over reserved device address space, mapped page by page."""

    def __init__(self, config: KVCacheConfig, device: torch.device):
        self.config = config
        self.blocks_per_page = config.blocks_per_page
        self.driver = CudaDriver(device)
        granularity = self.driver.granularity()
        self.mapped: set[int] = set()
        self._unplanned: set[int] = set()  # mapped for a dummy step
        self.regions: list[_Region] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        for tensor_spec in config.tensors:
            spec = config.groups[config.group_of(tensor_spec.shared_by[0])].spec
            half = spec.page_size_bytes // 2
            assert half * self.blocks_per_page % granularity == 0, "pages must fill whole granules"
            size = -(-tensor_spec.size_bytes // granularity) * granularity
            ptr = self.driver.reserve(size)
            raw = torch.as_tensor(_ArrayInterface(ptr, tensor_spec.size_bytes), device=device)
            shape = config.layout.shape(
                config.virtual_num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
            )
            tensor = raw.view(spec.dtype).view(shape)
            self.regions.append(_Region(ptr, size, half, config.virtual_num_blocks, tensor))
            self.kv_caches.update(config.layer_views(tensor_spec, tensor))

    @property
    def page_bytes(self) -> int:
        return sum(2 * r.half_bytes * self.blocks_per_page for r in self.regions)

    def apply(self, changes: PageChanges | None) -> None:
        if changes is None or changes.is_empty:
            return
        if changes.full_sync:
            self._return([p for p in self.mapped if p not in set(changes.mapped)])
        self._commit(p for p in changes.mapped if p not in self.mapped)
        self._return(changes.unmapped)

    def map_blocks(self, block_ids: Iterable[int]) -> None:
        """Map the pages of blocks a dummy step uses (unmapped device memory faults)."""
        pages = {b // self.blocks_per_page for b in block_ids}
        self._unplanned |= pages - self.mapped
        self._commit(pages - self.mapped)

    def return_unplanned(self) -> None:
        """Return the pages `map_blocks` mapped."""
        self._return(list(self._unplanned))
        self._unplanned.clear()

    def usage(self) -> KVMemoryUsage:
        mapped = len(self.mapped) * self.page_bytes
        return KVMemoryUsage(sum(r.size for r in self.regions), mapped, mapped, len(self.mapped))

    def release(self) -> None:
        self._return(list(self.mapped))
        for region in self.regions:
            self.driver.free(region.ptr, region.size)
        self.regions.clear()

    def _commit(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        torch.cuda.synchronize(self.driver.device_index)
        for region in self.regions:
            for page in pages:
                for half in (0, 1):
                    ptr, length = region.range(page, half, self.blocks_per_page)
                    region.handles[(page, half)] = self.driver.map(ptr, length)
            for first, count in page_runs(pages):  # fresh memory reads as zeros, as eager's does
                blocks = slice(first * self.blocks_per_page, (first + count) * self.blocks_per_page)
                region.tensor[:, blocks].zero_()
        self.mapped.update(pages)

    def _return(self, pages: Iterable[int]) -> None:
        pages = [p for p in pages if p in self.mapped]
        if not pages:
            return
        torch.cuda.synchronize(self.driver.device_index)  # no kernel may still read them
        for region in self.regions:
            for page in pages:
                for half in (0, 1):
                    ptr, length = region.range(page, half, self.blocks_per_page)
                    self.driver.unmap(ptr, length, region.handles.pop((page, half)))
        self.mapped.difference_update(pages)
