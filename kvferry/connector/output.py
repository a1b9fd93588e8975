"""Typed worker -> scheduler connector results (invariant 3)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVConnectorStats:
    """Counters a connector reports per step; merged across workers with aggregate()."""

    data: dict[str, float] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0) + value
        return type(self)(merged)

    def is_empty(self) -> bool:
        return not self.data


@dataclass
class KVConnectorOutput:
    finished_sending: set[str] = field(default_factory=set)  # blocks may be freed
    finished_recving: set[str] = field(default_factory=set)  # KV is in place: runnable
    failed_recving: set[str] = field(default_factory=set)  # load failed: apply the policy
    invalid_block_ids: set[int] = field(default_factory=set)  # blocks whose content is not valid
    stats: KVConnectorStats | None = None
    events: list[object] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.finished_recving
            or self.failed_recving
            or self.invalid_block_ids
            or (self.stats and not self.stats.is_empty())
            or self.events
        )
