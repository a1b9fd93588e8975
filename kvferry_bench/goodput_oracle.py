"""The prefix-cache hit rate an all-knowing router would reach on a request trace.

The oracle sees every instance's prefix cache exactly: each request goes to the instance
holding the longest cached prefix of its prompt (ties: the instance that has taken the
fewest requests, then the lowest index), which then caches the prompt's full blocks. Each
instance keeps at most ``capacity_blocks`` blocks, evicting the least recently used.
Hits follow the engine's rule (``KVCacheManager.get_computed_blocks``): only full blocks
of the prompt without its last token count, so a prompt's last token is always computed;
queries are every prompt token. The bench compares the hit rate the instances report
against this bound (issue 22's target: prefix routing reaches at least 90% of it).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

BlockKey = int  # a hash of a block's tokens chained with its parent's key, as the engine's


@dataclass(frozen=True)
class OracleResult:
    queries: int  # prompt tokens looked up
    hits: int  # of those, tokens found cached on the chosen instance
    requests_per_instance: tuple[int, ...]

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


class _InstanceCache:
    """One instance's prefix cache: block keys, least recently used first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[BlockKey, None] = OrderedDict()
        self.requests = 0

    def cached_blocks(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys`` (a prompt's blocks, in order) are cached, from the first."""
        count = 0
        for key in keys:
            if key not in self.blocks:
                break
            count += 1
        return count

    def store(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def block_keys(prompt: Sequence[int], block_size: int, num_blocks: int) -> list[BlockKey]:
    """The keys of the prompt's first ``num_blocks`` full blocks: equal keys, equal prefixes."""
    keys: list[BlockKey] = []
    parent = 0
    for i in range(num_blocks):
        parent = hash((parent, tuple(prompt[i * block_size : (i + 1) * block_size])))
        keys.append(parent)
    return keys


def oracle_hit_rate(
    prompts: Sequence[Sequence[int]], num_instances: int, capacity_blocks: int, block_size: int
) -> OracleResult:
    """The trace's hit rate when every request goes where most of its prompt is cached."""
    if num_instances < 1 or capacity_blocks < 1 or block_size < 1:
        raise ValueError(
            f"instances ({num_instances}), capacity ({capacity_blocks}) and block size "
            f"({block_size}) must be at least 1"
        )
    caches = [_InstanceCache(capacity_blocks) for _ in range(num_instances)]
    queries = hits = 0
    for prompt in prompts:
        keys = block_keys(prompt, block_size, len(prompt) // block_size)
        lookup = keys[: (len(prompt) - 1) // block_size]
        found = [cache.cached_blocks(lookup) for cache in caches]
        best = min(range(num_instances), key=lambda i: (-found[i], caches[i].requests, i))
        queries += len(prompt)
        hits += found[best] * block_size
        caches[best].requests += 1
        caches[best].store(keys)
    return OracleResult(queries, hits, tuple(cache.requests for cache in caches))
