"""Measure the memory one rank has for its KV cache: the profiling step's activation peak
and what the host (or device) has left after the weights.

CPU: the process's peak resident set (VmHWM) is reset through /proc/self/clear_refs
before the profiling step and read after it; what is left is MemAvailable, shared by the
ranks of this host. Memory the C allocator keeps resident after earlier frees would absorb
the step's allocations without raising the peak (an engine built in a process that already
ran models measured 4 MiB for a step that needs 40), so the probe first hands free heap
pages back to the kernel (glibc's malloc_trim, where the C library has it).

CUDA (unverified here: no GPU): the caching allocator's peak and the
device's free memory.
"""

from __future__ import annotations

import ctypes
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

PROC_STATUS = Path("/proc/self/status")
PROC_CLEAR_REFS = Path("/proc/self/clear_refs")
PROC_MEMINFO = Path("/proc/meminfo")
RESET_PEAK_RSS = "5"  # clear_refs: reset VmHWM to the current resident set


@dataclass(frozen=True)
class MemoryProfile:
    """One rank's measurement from the profiling step."""

    room_bytes: int  # this rank's share of free memory, less its activation peak
    activation_peak_bytes: int  # the step's peak above what was resident before it


class MemoryProbe(ABC):
    """start() before the profiling step, finish() after it."""

    def __init__(self, ranks_sharing_memory: int):
        self.ranks_sharing_memory = ranks_sharing_memory
        self._free_bytes = 0

    def start(self, released_after_bytes: int) -> None:
        """`released_after_bytes`: memory held now that is given back before the KV cache
        is allocated (the provisional cache of the profiling step)."""
        self._free_bytes = self.free_bytes() + released_after_bytes
        self.reset_peak()

    def finish(self) -> MemoryProfile:
        peak = max(0, self.peak_above_start())
        room = self._free_bytes // self.ranks_sharing_memory - peak
        return MemoryProfile(room_bytes=max(0, room), activation_peak_bytes=peak)

    @abstractmethod
    def free_bytes(self) -> int: ...

    @abstractmethod
    def reset_peak(self) -> None: ...

    @abstractmethod
    def peak_above_start(self) -> int: ...


def _read_kib(path: Path, field: str) -> int:
    for line in path.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    raise RuntimeError(f"{path} has no {field} line")


def release_free_heap_pages() -> bool:
    """Return the C allocator's free pages to the kernel; False where libc cannot."""
    libc = ctypes.CDLL(None)
    try:
        trim = libc.malloc_trim
    except AttributeError:  # not glibc: nothing to trim through
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


class HostMemoryProbe(MemoryProbe):
    def __init__(self, ranks_sharing_memory: int):
        super().__init__(ranks_sharing_memory)
        self._resident_at_start = 0

    def free_bytes(self) -> int:
        return _read_kib(PROC_MEMINFO, "MemAvailable")

    def reset_peak(self) -> None:
        if not release_free_heap_pages():
            logger.warning("no malloc_trim here: the activation peak may read low")
        PROC_CLEAR_REFS.write_text(RESET_PEAK_RSS)
        self._resident_at_start = _read_kib(PROC_STATUS, "VmRSS")

    def peak_above_start(self) -> int:
        return _read_kib(PROC_STATUS, "VmHWM") - self._resident_at_start


class CudaMemoryProbe(MemoryProbe):
    def __init__(self, device: torch.device):
        super().__init__(ranks_sharing_memory=1)  # a rank has its device to itself
        self.device = device
        self._allocated_at_start = 0

    def free_bytes(self) -> int:
        free, _total = torch.cuda.mem_get_info(self.device)
        return free

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._allocated_at_start = torch.cuda.memory_allocated(self.device)

    def peak_above_start(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self._allocated_at_start


def memory_probe(device: torch.device, ranks_on_host: int) -> MemoryProbe:
    if device.type == "cuda":
        return CudaMemoryProbe(device)
    return HostMemoryProbe(ranks_on_host)
