"""OffloadConfig: `kv_connector_extra_config` of the OffloadConnector, checked at start-up.

Capacities are for the whole instance. With tensor parallelism every rank stores only its
own KV heads of a block, at the same slot index as the other ranks, so a tier of
`dram_gib` GiB holds `dram_gib GiB / (bytes of one block over all ranks)` blocks, and each
rank allocates that many slots of its own size (ranks may hold different numbers of KV
heads: 3 heads over 2 ranks are 2 + 1). A KV head replicated on several ranks (fewer KV
heads than ranks; a latent-attention cache: one row every rank holds) is stored once, by
its owner rank (`tier_owner`); its replicas allocate no tier and receive the owner's copy.
`dram_blocks` / `disk_blocks` give the block count directly instead (tests, benchmarks).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from kvferry.errors import ConfigError
from kvferry.kv.spec import KVCacheConfig
from kvferry.model.layers.parallel import kv_head_range

logger = logging.getLogger(__name__)

GIB = 1 << 30
DEFAULT_DRAM_GIB = 1.0
KNOWN_KEYS = frozenset(
    {"dram_gib", "dram_blocks", "disk_dir", "disk_gib", "disk_blocks", "verify_checksum", "layerwise"}
)


def _number(extra: dict[str, object], key: str, integer: bool = False) -> float | None:
    value = extra.get(key)
    if value is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value < 0:
        what = "a non-negative integer" if integer else "a non-negative number"
        raise ConfigError(f"offload: {key} must be {what}, not {value!r}")
    return value


def _exclusive(extra: dict[str, object], gib_key: str, blocks_key: str) -> tuple[float | None, int | None]:
    gib, count = _number(extra, gib_key), _number(extra, blocks_key, integer=True)
    blocks = None if count is None else int(count)
    if gib is not None and blocks is not None:
        raise ConfigError(f"offload: give {gib_key} or {blocks_key}, not both")
    return gib, blocks


def _flag(extra: dict[str, object], key: str) -> bool:
    value = extra.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"offload: {key} must be true or false, not {value!r}")
    return value


def _check_dir(path: object) -> str:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"offload: disk_dir must be a directory path, not {path!r}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"offload: disk_dir {path!r} cannot be created: {exc}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"offload: disk_dir {path!r} is not writable")
    return path


@dataclass(frozen=True)
class OffloadConfig:
    dram_gib: float | None = DEFAULT_DRAM_GIB
    dram_blocks: int | None = None
    disk_dir: str | None = None
    disk_gib: float | None = None
    disk_blocks: int | None = None
    verify_checksum: bool = False  # crc32 of each slot's payload, checked on every load
    # Loads and saves layer by layer in the per-layer hooks (False: whole blocks before and
    # after the forward; see kvferry/connector/offload/layerwise.py).
    layerwise: bool = False

    @classmethod
    def from_extra(cls, extra: dict[str, object]) -> OffloadConfig:
        unknown = set(extra) - KNOWN_KEYS
        if unknown:
            raise ConfigError(f"offload: unknown keys {sorted(unknown)}; known: {sorted(KNOWN_KEYS)}")
        dram_gib, dram_blocks = _exclusive(extra, "dram_gib", "dram_blocks")
        if dram_gib is None and dram_blocks is None:
            dram_gib = DEFAULT_DRAM_GIB
        disk_gib, disk_blocks = _exclusive(extra, "disk_gib", "disk_blocks")
        disk_dir = extra.get("disk_dir")
        has_disk = disk_gib is not None or disk_blocks is not None
        if has_disk and disk_dir is None:
            raise ConfigError("offload: disk_gib/disk_blocks need a disk_dir")
        if disk_dir is not None and not has_disk:
            raise ConfigError("offload: disk_dir needs a capacity (disk_gib or disk_blocks)")
        if disk_dir is not None:
            disk_dir = _check_dir(disk_dir)
        verify, layerwise = _flag(extra, "verify_checksum"), _flag(extra, "layerwise")
        return cls(dram_gib, dram_blocks, disk_dir, disk_gib, disk_blocks, verify, layerwise)

    def num_slots(self, block_bytes: int) -> tuple[int, int]:
        """(DRAM slots, disk slots) for blocks of `block_bytes` over all ranks together."""

        def slots(gib: float | None, blocks: int | None) -> int:
            if blocks is not None:
                return blocks
            return int(gib * GIB // block_bytes) if gib else 0

        dram = slots(self.dram_gib, self.dram_blocks)
        disk = slots(self.disk_gib, self.disk_blocks) if self.disk_dir is not None else 0
        if dram == 0 and disk == 0:
            raise ConfigError(
                f"offload: the tiers hold no block (one block takes {block_bytes} bytes over all "
                "ranks); raise dram_gib or disk_gib"
            )
        return dram, disk


def slot_bytes_per_rank(kv_cache_config: KVCacheConfig) -> int:
    """Bytes one block position takes on one rank: a page of every KV tensor for each group
    it serves (hybrid allocation: one tensor, one page per group; a tensor shared by layers
    of one group counted once)."""
    total = 0
    for gid, group in enumerate(kv_cache_config.groups):
        serving = sum(
            1 for t in kv_cache_config.tensors if any(kv_cache_config.group_of(n) == gid for n in t.shared_by)
        )
        total += serving * group.spec.page_size_bytes
    return total


def instance_block_bytes(kv_cache_config: KVCacheConfig, total_kv_heads: int, tp_size: int) -> int:
    """Bytes one block position takes over every rank: the same number in every half and rank.

    Ranks differ only in their KV head count, so bytes per head are common; the ranks
    together hold every KV head at least once.
    Every KV head is stored once: a head replicated on several ranks is saved by one of
    them (`tier_owner`). One rank holds them all. Groups with different KV head counts (Gemma 4's global layers)
    give no common count over several ranks (a rank knows only its own heads): refused.
    """
    if tp_size == 1:
        return slot_bytes_per_rank(kv_cache_config)
    heads = {group.spec.num_kv_heads for group in kv_cache_config.groups}
    if len(heads) != 1:
        raise ConfigError(
            f"offload: KV cache groups with different KV head counts {sorted(heads)} are not "
            f"supported with tensor parallelism ({tp_size} ranks)"
        )
    per_head = slot_bytes_per_rank(kv_cache_config) // heads.pop()
    return per_head * total_kv_heads


def tier_owner(rank: int, tp_size: int, total_kv_heads: int) -> int:
    """The rank whose tiers hold rank `rank`'s KV heads: itself, or for a replicated head
    (fewer KV heads than ranks; a latent-attention cache's one row) the lowest rank holding
    it. Only owners save; a replica receives the owner's copy on every load."""
    if total_kv_heads >= tp_size:
        return rank
    head = kv_head_range(rank, tp_size, total_kv_heads)[0]
    return min(r for r in range(tp_size) if kv_head_range(r, tp_size, total_kv_heads)[0] == head)


def tier_owners(tp_size: int, total_kv_heads: int) -> list[int]:
    """The ranks that own a copy in the tiers, ascending (every rank without replicas)."""
    return sorted({tier_owner(r, tp_size, total_kv_heads) for r in range(tp_size)})


def check_kv_cache_config(kv_cache_config: KVCacheConfig) -> None:
    if not kv_cache_config.tensors:
        raise ConfigError("offload: the KV cache config lists no tensors")
