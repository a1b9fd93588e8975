"""The host memory probe reads a step's peak even where the C allocator holds freed pages
resident (a process that already loaded and dropped a model): it hands them back first."""

from __future__ import annotations

import torch

from kvferry.worker.memory_profile import HostMemoryProbe

MIB = 1 << 20
CHUNK = 8 * MIB


def _leave_freed_heap_resident() -> torch.Tensor:
    """Free 200 MiB that glibc keeps resident: freeing a 24 MiB mapping raises its mmap
    threshold, so the next tensors come from the heap, and one kept above them stops the
    heap's top from shrinking when they are freed. Returns that tensor."""
    torch.ones(24 * MIB // 4)  # allocated and freed at once
    freed = [torch.ones(CHUNK // 4) for _ in range(25)]
    kept = torch.ones(CHUNK // 4)
    del freed
    return kept


def test_a_step_allocating_on_freed_heap_pages_still_reads_its_peak() -> None:
    kept = _leave_freed_heap_resident()
    probe = HostMemoryProbe(ranks_sharing_memory=1)
    probe.start(released_after_bytes=0)
    step = [torch.ones(CHUNK // 4) for _ in range(10)]  # 80 MiB, touched
    profile = probe.finish()
    del step, kept
    assert profile.activation_peak_bytes >= 70 * MIB, profile
