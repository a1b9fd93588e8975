"""BlockCopier: whole KV blocks between the device KV tensors and flat slot rows.

A slot row holds one block of every KV tensor of this rank, back to back, each as its K
bytes then its V bytes. Tensors shared by several layers are copied once (deduplicated
by base address). The copy is byte-exact and layout-agnostic: a block's bytes are moved
as they are, so NHD and HND both work (the tiers belong to one instance, one layout).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvferry.kv.spec import KVCacheConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Segment:
    view: torch.Tensor  # uint8 [2, virtual_num_blocks, half_bytes] over the KV tensor's storage
    group: int  # KV cache group: which of a block's ids (one per group) addresses it
    offset: int  # in the slot row
    half: int  # bytes of K (= bytes of V) of one block


class BlockCopier:
    def __init__(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig):
        self.segments: list[_Segment] = []
        seen: set[int] = set()
        offset = 0
        for tensor_spec in kv_cache_config.tensors:
            layer = tensor_spec.shared_by[0]
            tensor = kv_caches[layer]
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            group = kv_cache_config.group_of(layer)
            half = kv_cache_config.groups[group].spec.page_size_bytes // 2
            view = _block_view(tensor, tensor_spec.size_bytes, kv_cache_config.virtual_num_blocks, half)
            self.segments.append(_Segment(view, group, offset, half))
            offset += 2 * half
        self.slot_bytes = offset
        self.device = self.segments[0].view.device if self.segments else torch.device("cpu")

    def gather(self, block_ids: list[tuple[int, ...]], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks as CPU rows [n, slot_bytes] (block_ids: one id per group per block)."""
        n = len(block_ids)
        if out is None:
            out = torch.empty((n, self.slot_bytes), dtype=torch.uint8)
        # On a CPU block by block: each copy stays below torch's parallel grain, so the
        # background thread that saves does not start thread teams beside the forward's.
        # On a GPU whole runs: each device-to-host copy waits for the device.
        max_run = 1 if self.device.type == "cpu" else None
        runs = self._runs_per_group(block_ids, max_run)
        for seg in self.segments:
            dst = out[:, seg.offset : seg.offset + 2 * seg.half].view(n, 2, seg.half).transpose(0, 1)
            for row, block, length in runs[seg.group]:
                dst[:, row : row + length].copy_(seg.view[:, block : block + length])
        return out

    def scatter(self, rows: torch.Tensor, block_ids: list[tuple[int, ...]]) -> None:
        """Write rows [n, slot_bytes] into the device blocks (before the forward: one strided
        copy per run of consecutive blocks, free to use every thread)."""
        n = len(block_ids)
        runs = self._runs_per_group(block_ids)
        for seg in self.segments:
            src = rows[:, seg.offset : seg.offset + 2 * seg.half].view(n, 2, seg.half).transpose(0, 1)
            src = src.to(self.device, non_blocking=True)
            for row, block, length in runs[seg.group]:
                seg.view[:, block : block + length].copy_(src[:, row : row + length])

    def _runs_per_group(
        self, block_ids: list[tuple[int, ...]], max_run: int | None = None
    ) -> dict[int, list[tuple[int, int, int]]]:
        """Each KV cache group's runs, computed once for all of its layers."""
        groups = {seg.group for seg in self.segments}
        return {group: _runs([ids[group] for ids in block_ids], max_run) for group in groups}


def _block_view(tensor: torch.Tensor, size_bytes: int, capacity: int, half: int) -> torch.Tensor:
    """The tensor's bytes as [2, capacity, half]: K or V, block, the block's bytes. Sizes come
    from the KVCacheConfig (invariant 4): `capacity` is its virtual_num_blocks (elastic memory
    reserves ids past the budget), `half` its spec's page size / 2."""
    assert size_bytes == 2 * capacity * half, "KV tensor size disagrees with its spec"
    assert tensor.is_contiguous(), "KV tensor is not contiguous"
    flat = tensor.view(-1).view(torch.uint8)
    assert flat.numel() == size_bytes, f"KV tensor holds {flat.numel()} bytes, its config says {size_bytes}"
    return flat.view(2, capacity, half)


def _runs(block_ids: list[int], max_run: int | None = None) -> list[tuple[int, int, int]]:
    """(first row, first block, length) of each run of consecutive block ids (at most
    `max_run` long).

    Strided copies of whole runs are memcpy-bound; index_copy_ over wide rows was measured
    ~10x slower on CPU, and block tables are mostly consecutive.
    """
    runs: list[tuple[int, int, int]] = []
    for row, block in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block and runs[-1][2] != max_run:
            first_row, first_block, length = runs[-1]
            runs[-1] = (first_row, first_block, length + 1)
        else:
            runs.append((row, block, 1))
    return runs


class Staging:
    """Grow-only CPU rows for one thread's copies: fresh memory on every step would cost page
    faults several times the copy itself on CPU."""

    def __init__(self, slot_bytes: int, pin_memory: bool = False):
        self.slot_bytes = slot_bytes
        self.pin_memory = pin_memory
        self._buf = torch.empty((0, slot_bytes), dtype=torch.uint8)

    def take(self, n: int) -> torch.Tensor:
        if self._buf.shape[0] < n:
            self._buf = torch.empty((n, self.slot_bytes), dtype=torch.uint8, pin_memory=self.pin_memory)
        return self._buf[:n]
