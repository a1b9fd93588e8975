"""BlockCopier: whole KV blocks between the device KV tensors and flat slot rows.

A slot row holds one block position of a request in every KV cache group: for each group,
one page of every KV tensor that serves a layer of the group, back to back, each as its K
bytes then its V bytes. A tensor shared by layers of several groups (hybrid allocation)
appears once per group, addressed by that group's block id; layers of one group sharing a
tensor are copied once (deduplicated by base address). A group's pages are contiguous in
the row (`group_ranges`), so a tier can move just the groups a block position needs. A
block id of SKIP leaves that group out of a copy (a sliding-window group's block no window
sees). The copy is byte-exact and layout-agnostic: a block's bytes are moved as they are,
so NHD and HND both work (the tiers belong to one instance, one layout).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvferry.kv.spec import KVCacheConfig, KVCacheTensor, SlidingWindowSpec

logger = logging.getLogger(__name__)

SKIP = -1  # a block id that leaves its group out of a copy


def groups_present(block_ids: tuple[int, ...]) -> frozenset[int]:
    """The groups a block position's ids include (those not SKIP)."""
    return frozenset(group for group, block in enumerate(block_ids) if block != SKIP)


@dataclass
class _Segment:
    view: torch.Tensor  # uint8 [2, virtual_num_blocks, half_bytes] over the KV tensor's storage
    group: int  # KV cache group: which of a block's ids (one per group) addresses it
    offset: int  # in the slot row
    half: int  # bytes of K (= bytes of V) of one block
    layers: list[str]  # the group's layers whose KV it holds (several when they share it)


class BlockCopier:
    def __init__(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig):
        self.segments: list[_Segment] = []
        self.group_ranges: dict[int, tuple[int, int]] = {}  # group -> its bytes in a row
        self.group_bytes: dict[int, int] = {}
        offset = 0
        for group, members in segment_order(kv_cache_config):
            start = offset
            half = kv_cache_config.groups[group].spec.page_size_bytes // 2
            seen: dict[int, _Segment] = {}
            for tensor_spec, layer in members:
                tensor = kv_caches[layer]
                if tensor.data_ptr() in seen:
                    seen[tensor.data_ptr()].layers.append(layer)
                    continue
                view = _block_view(tensor, tensor_spec.size_bytes, kv_cache_config.virtual_num_blocks, half)
                seen[tensor.data_ptr()] = _Segment(view, group, offset, half, [layer])
                self.segments.append(seen[tensor.data_ptr()])
                offset += 2 * half
            self.group_ranges[group] = (start, offset)
            self.group_bytes[group] = offset - start
        self.slot_bytes = offset
        self.device = self.segments[0].view.device if self.segments else torch.device("cpu")

    def ranges(self, groups: Iterable[int]) -> list[tuple[int, int]]:
        """The row's byte ranges holding `groups`, adjacent ones merged, in row order."""
        merged: list[tuple[int, int]] = []
        for start, stop in sorted(self.group_ranges[g] for g in groups):
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], stop)
            elif stop > start:
                merged.append((start, stop))
        return merged

    def bytes_of(self, block_ids: tuple[int, ...]) -> int:
        """Bytes a copy of one block position moves (SKIP groups excluded)."""
        return sum(self.group_bytes[g] for g in groups_present(block_ids))

    def gather(
        self,
        block_ids: list[tuple[int, ...]],
        out: torch.Tensor | None = None,
        segments: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """The blocks as CPU rows [n, slot_bytes] (block_ids: one id per group per block);
        `segments` (indices into `self.segments`): only those parts of the rows (None: all)."""
        n = len(block_ids)
        if out is None:
            out = torch.empty((n, self.slot_bytes), dtype=torch.uint8)
        # On a CPU block by block: each copy stays below torch's parallel grain, so the
        # background thread that saves does not start thread teams beside the forward's.
        # On a GPU whole runs: each device-to-host copy waits for the device.
        max_run = 1 if self.device.type == "cpu" else None
        runs = self._runs_per_group(block_ids, max_run)
        for seg in self._chosen(segments):
            dst = out[:, seg.offset : seg.offset + 2 * seg.half].view(n, 2, seg.half).transpose(0, 1)
            for row, block, length in runs[seg.group]:
                dst[:, row : row + length].copy_(seg.view[:, block : block + length])
        return out

    def scatter(
        self,
        rows: torch.Tensor,
        block_ids: list[tuple[int, ...]],
        segments: Sequence[int] | None = None,
        max_run: int | None = None,
    ) -> None:
        """Write rows [n, slot_bytes] into the device blocks: one strided copy per run of
        consecutive blocks (at most `max_run` long: a thread beside the forward copies block
        by block on a CPU, below torch's parallel grain); `segments`: only those (None: all)."""
        n = len(block_ids)
        runs = self._runs_per_group(block_ids, max_run)
        for seg in self._chosen(segments):
            src = rows[:, seg.offset : seg.offset + 2 * seg.half].view(n, 2, seg.half).transpose(0, 1)
            src = src.to(self.device, non_blocking=True)
            for row, block, length in runs[seg.group]:
                seg.view[:, block : block + length].copy_(src[:, row : row + length])

    def _chosen(self, segments: Sequence[int] | None) -> list[_Segment]:
        return self.segments if segments is None else [self.segments[i] for i in segments]

    def segment_ranges(self, segments: Sequence[int], groups: frozenset[int]) -> list[tuple[int, int]]:
        """The row's byte ranges of `segments` whose group is in `groups` (adjacent merged)."""
        merged: list[tuple[int, int]] = []
        for i in sorted(segments, key=lambda i: self.segments[i].offset):
            seg = self.segments[i]
            if seg.group not in groups:
                continue
            start, stop = seg.offset, seg.offset + 2 * seg.half
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], stop)
            else:
                merged.append((start, stop))
        return merged

    def _runs_per_group(
        self, block_ids: list[tuple[int, ...]], max_run: int | None = None
    ) -> dict[int, list[tuple[int, int, int]]]:
        """Each KV cache group's runs, computed once for all of its layers (SKIP rows left out)."""
        groups = {seg.group for seg in self.segments}
        return {
            group: _runs(
                [(row, ids[group]) for row, ids in enumerate(block_ids) if ids[group] != SKIP], max_run
            )
            for group in groups
        }


def segment_order(kv_cache_config: KVCacheConfig) -> list[tuple[int, list[tuple[KVCacheTensor, str]]]]:
    """Per group, full-attention groups first (a position no window sees needs only those,
    one contiguous range), the (tensor, member layer) pairs a slot row holds, in tensor order."""
    groups = sorted(
        range(len(kv_cache_config.groups)),
        key=lambda g: isinstance(kv_cache_config.groups[g].spec, SlidingWindowSpec),
    )
    order = []
    for group in groups:
        members = [
            (tensor, layer)
            for tensor in kv_cache_config.tensors
            for layer in tensor.shared_by
            if kv_cache_config.group_of(layer) == group
        ]
        order.append((group, members))
    return order


def _block_view(tensor: torch.Tensor, size_bytes: int, capacity: int, half: int) -> torch.Tensor:
    """The tensor's bytes as [2, capacity, half]: K or V, block, the block's bytes. Sizes come
    from the KVCacheConfig (invariant 4): `capacity` is its virtual_num_blocks (elastic memory
    reserves ids past the budget), `half` its spec's page size / 2."""
    assert size_bytes == 2 * capacity * half, "KV tensor size disagrees with its spec"
    assert tensor.is_contiguous(), "KV tensor is not contiguous"
    flat = tensor.view(-1).view(torch.uint8)
    assert flat.numel() == size_bytes, f"KV tensor holds {flat.numel()} bytes, its config says {size_bytes}"
    return flat.view(2, capacity, half)


def _runs(rows: list[tuple[int, int]], max_run: int | None = None) -> list[tuple[int, int, int]]:
    """(first row, first block, length) of each run of (row, block id) pairs whose rows and
    ids both go up by one (at most `max_run` long).

    Strided copies of whole runs are memcpy-bound; index_copy_ over wide rows was measured
    ~10x slower on CPU, and block tables are mostly consecutive.
    """
    runs: list[tuple[int, int, int]] = []
    for row, block in rows:
        last = runs[-1] if runs else None
        if last and last[0] + last[2] == row and last[1] + last[2] == block and last[2] != max_run:
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
