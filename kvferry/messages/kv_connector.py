"""Typed worker -> scheduler connector results (invariant 3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A connector's kv_transfer_params: the JSON object it hands the client at a request's end
# and reads back in the next instance's request (P/D: engine id, block ids, ...).
KVTransferParams = dict[str, Any]


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
    # P/D, layer-wise: a streamed remote prefill's first token, per request receiving it
    # (the prefiller sends it with its acknowledgement; the decoder's first token is it).
    remote_first_tokens: dict[str, int] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (
            self.remote_first_tokens
            or self.finished_sending
            or self.finished_recving
            or self.failed_recving
            or self.invalid_block_ids
            or (self.stats and not self.stats.is_empty())
            or self.events
        )


_ID_FIELDS = ("finished_sending", "finished_recving", "failed_recving")


def checked_output(output: object) -> KVConnectorOutput | None:
    """`output` as a KVConnectorOutput, or None; anything malformed raises TypeError.

    The scheduler acts on these sets (frees blocks, wakes requests): a wrong type must
    fail loudly rather than read as an empty result.
    """
    if output is None:
        return None
    if not isinstance(output, KVConnectorOutput):
        raise TypeError(
            f"a worker's connector output must be a KVConnectorOutput, got {type(output).__name__}"
        )
    for name in _ID_FIELDS:
        _check_set(output, name, str)
    _check_set(output, "invalid_block_ids", int)
    tokens = output.remote_first_tokens
    if not isinstance(tokens, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in tokens.items()
    ):
        raise TypeError(f"KVConnectorOutput.remote_first_tokens must map str to int, got {tokens!r}")
    if output.stats is not None and not isinstance(output.stats, KVConnectorStats):
        raise TypeError(
            f"KVConnectorOutput.stats must be KVConnectorStats, got {type(output.stats).__name__}"
        )
    return output


def _check_set(output: KVConnectorOutput, name: str, item: type) -> None:
    value = getattr(output, name)
    if not isinstance(value, set) or not all(isinstance(v, item) for v in value):
        raise TypeError(f"KVConnectorOutput.{name} must be a set of {item.__name__}, got {value!r}")
