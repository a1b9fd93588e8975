"""Which instance holds which cached blocks, learned from the instances' KV events.

One bounded set of block hashes per instance (insertion order: past `max_blocks` the
oldest entries are forgotten, which can only make the proxy under-estimate a hit). The
index is a hint for routing: a wrong or stale entry costs a cache miss, never a wrong
answer, since every instance checks its own cache.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvferry.scheduler.hashing import BlockHash
from kvferry.scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)

DEFAULT_MAX_BLOCKS = 1_000_000  # per instance: 32-byte hashes, about 100 MB at the cap


@dataclass(frozen=True)
class RouteKey:
    """What a routing policy knows of a request: its prompt's length and full blocks' hashes."""

    num_tokens: int
    block_hashes: tuple[BlockHash, ...]


class PrefixIndex:
    """Block hash -> the instances (by URL) that hold it, per instance bounded."""

    def __init__(self, block_size: int, max_blocks: int = DEFAULT_MAX_BLOCKS):
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._held: dict[str, OrderedDict[BlockHash, None]] = {}
        self.num_mismatched = 0  # BlockStored events of another block size (ignored)

    def apply(self, url: str, batch: KVEventBatch) -> None:
        """One batch of `url`'s events, in order."""
        held = self._held.setdefault(url, OrderedDict())
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(url, held, event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    held.pop(block_hash, None)
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    def _store(self, url: str, held: OrderedDict[BlockHash, None], event: BlockStored) -> None:
        if event.block_size != self.block_size:
            if not self.num_mismatched:
                logger.warning(
                    "%s caches blocks of %d tokens, the proxy hashes %d (--block-size): its events are ignored",
                    url,
                    event.block_size,
                    self.block_size,
                )
            self.num_mismatched += 1
            return
        for block_hash in event.block_hashes:
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def forget(self, url: str) -> None:
        """Everything known of `url` (it restarted, or its events were lost)."""
        self._held.pop(url, None)

    def num_blocks(self, url: str) -> int:
        return len(self._held.get(url, ()))

    def cached_blocks(self, url: str, hashes: Sequence[BlockHash]) -> int:
        """How many of a prompt's leading blocks `url` holds (its longest cached prefix)."""
        held = self._held.get(url)
        if not held:
            return 0
        for i, block_hash in enumerate(hashes):
            if block_hash not in held:
                return i
        return len(hashes)
