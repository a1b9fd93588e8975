"""Per-step scheduler -> worker message of the OffloadConnector.

Workers run the loads first (synchronously, before the forward), then the tier ops in
list order in one background job after the forward. The scheduler builds both lists in
that same order, so a slot freed and reused within one step is read before it is written.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvferry.connector.base import KVConnectorMetadata


class Tier(enum.IntEnum):
    DRAM = 0
    DISK = 1


@dataclass(frozen=True)
class LoadOp:
    """Copy tier slot -> the device blocks (one per KV cache group) of a request; a group
    whose id is SKIP (blocks.SKIP) is not loaded (no window sees it)."""

    req_id: str
    tier: Tier
    slot: int
    block_hash: bytes
    epoch: int  # the save that wrote the slot; the worker verifies it
    block_ids: tuple[int, ...]
    stored: frozenset[int] = frozenset({0})  # the groups the save wrote (a checksum covers them)


@dataclass(frozen=True)
class SaveOp:
    """Copy a request's device blocks (one per group) -> tier slot, tagged (hash, epoch); a
    group whose id is SKIP is not saved (its block was never allocated: no window sees it)."""

    req_id: str
    tier: Tier
    slot: int
    block_hash: bytes
    epoch: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class DemoteOp:
    """Move a DRAM slot to a disk slot (the DRAM slot is reused afterwards)."""

    dram_slot: int
    disk_slot: int
    block_hash: bytes
    epoch: int


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    instance_id: str = ""  # the scheduler half's id, echoed in worker events
    loads: list[LoadOp] = field(default_factory=list)
    ops: list[SaveOp | DemoteOp] = field(default_factory=list)
    # Requests preempted since the last step: their blocks may already be reused, so the
    # worker finishes their pending saves before this step's loads and forward.
    preempted: list[str] = field(default_factory=list)
    idle: bool = False  # nothing scheduled: the worker may wait a little for pending saves
    num_evicted: int = 0  # blocks the index dropped this step (reported as a stat)


@dataclass(frozen=True)
class SaveFailed:
    """Worker event: a save or demotion failed; the scheduler drops the entry if unchanged."""

    instance_id: str
    block_hash: bytes
    epoch: int
