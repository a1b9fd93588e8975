"""TierIndex: the scheduler half's authoritative map block hash -> (tier, slot, epoch).

One LRU order per tier. New blocks go to DRAM (or to disk when there is no DRAM tier).
A full DRAM tier demotes its least recently used entry to disk; a full disk tier (or a
full DRAM tier without disk) drops its least recently used entry. Every decision that
moves bytes comes back as an op for the workers, in the order it must run.

An entry also says which KV cache groups its slot holds: every group, except sliding-window
groups whose block at that position no window could see any more when it was saved.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from kvferry.connector.offload.metadata import DemoteOp, Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    tier: Tier
    slot: int
    epoch: int
    groups: frozenset[int] = frozenset({0})  # KV cache groups whose block the slot holds


class TierIndex:
    def __init__(self, dram_slots: int, disk_slots: int):
        assert dram_slots >= 0 and disk_slots >= 0 and dram_slots + disk_slots > 0
        self.capacity = {Tier.DRAM: dram_slots, Tier.DISK: disk_slots}
        self._lru: dict[Tier, OrderedDict[bytes, Entry]] = {t: OrderedDict() for t in Tier}
        # Free slots, lowest first (popped from the end).
        self._free: dict[Tier, list[int]] = {t: list(range(n - 1, -1, -1)) for t, n in self.capacity.items()}
        self._where: dict[bytes, Tier] = {}
        self.num_demoted = 0
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._where

    def num_entries(self, tier: Tier) -> int:
        return len(self._lru[tier])

    def get(self, block_hash: bytes) -> Entry | None:
        tier = self._where.get(block_hash)
        return None if tier is None else self._lru[tier][block_hash]

    def touch(self, block_hash: bytes) -> Entry | None:
        """Look up and mark most recently used."""
        tier = self._where.get(block_hash)
        if tier is None:
            return None
        self._lru[tier].move_to_end(block_hash)
        return self._lru[tier][block_hash]

    def groups_of(self, block_hash: bytes) -> frozenset[int]:
        entry = self.get(block_hash)
        return frozenset() if entry is None else entry.groups

    def count_prefix(self, hashes: list[bytes], start: int, stop: int) -> int:
        """How many of hashes[start:stop] are stored, consecutively from start."""
        n = 0
        while start + n < min(stop, len(hashes)) and hashes[start + n] in self._where:
            n += 1
        return n

    def insert(
        self, block_hash: bytes, epoch: int, groups: frozenset[int] = frozenset({0})
    ) -> tuple[Entry, list[DemoteOp]]:
        """A slot for a new block (not stored yet), and the demotions that make room first."""
        assert block_hash not in self._where, "a stored block is not saved again"
        tier = Tier.DRAM if self.capacity[Tier.DRAM] > 0 else Tier.DISK
        ops: list[DemoteOp] = []
        slot = self._take_slot(tier, ops)
        entry = Entry(tier, slot, epoch, groups)
        self._lru[tier][block_hash] = entry
        self._where[block_hash] = tier
        return entry, ops

    def remove(self, block_hash: bytes, epoch: int | None = None) -> bool:
        """Forget a block (its slot becomes free); with epoch, only if it is still that save."""
        entry = self.get(block_hash)
        if entry is None or (epoch is not None and entry.epoch != epoch):
            return False
        del self._lru[entry.tier][block_hash]
        del self._where[block_hash]
        self._free[entry.tier].append(entry.slot)
        return True

    def _take_slot(self, tier: Tier, ops: list[DemoteOp]) -> int:
        if self._free[tier]:
            return self._free[tier].pop()
        victim, entry = self._lru[tier].popitem(last=False)
        del self._where[victim]
        if tier is Tier.DRAM and self.capacity[Tier.DISK] > 0:
            disk_slot = self._take_slot(Tier.DISK, ops)
            ops.append(DemoteOp(entry.slot, disk_slot, victim, entry.epoch))
            self._lru[Tier.DISK][victim] = Entry(Tier.DISK, disk_slot, entry.epoch, entry.groups)
            self._where[victim] = Tier.DISK
            self.num_demoted += 1
        else:
            self.num_dropped += 1
        return entry.slot
