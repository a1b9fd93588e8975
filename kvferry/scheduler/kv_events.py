"""KV cache events: what the prefix cache gained and lost, in vLLM's `--kv-events-config` schema.

The block pool records an event when a full block's hash enters the prefix cache
(`BlockStored`), when a cached block is taken for reuse (`BlockRemoved`) and when the whole
cache is forgotten (`AllBlocksCleared`). The engine core takes them once per step and
publishes them as one `KVEventBatch` (kvferry.engine.kv_event_publisher).

Wire layout (the one vLLM's routers read): every struct is a msgpack array
(`array_like`); an event is tagged with its class name as the array's first element; a
batch is `[ts, [events...]]` (plus `data_parallel_rank` when set). Block hashes are
kvferry's 32-byte sha256 digests (kvferry.scheduler.hashing); a first block's parent is
None. `lora_id` is always None and `medium` "GPU" for device memory, "CPU" for host memory
(vLLM's names for where the KV lives).
"""

from __future__ import annotations

import logging

import msgspec

from kvferry.scheduler.hashing import ROOT_HASH, BlockContent, BlockHash

logger = logging.getLogger(__name__)


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change of an instance's prefix cache."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of one prefix entered the cache (token_ids: all their tokens)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks left the cache (taken for other tokens)."""

    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every cached block left (a reset, or events were lost and the rest cannot be trusted)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events, in the order they happened."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


KVEventsList = list[BlockStored | BlockRemoved | AllBlocksCleared]

KV_EVENT_ENCODER = msgspec.msgpack.Encoder()
KV_EVENT_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class KVEventRecorder:
    """Collects the block pool's events until the engine takes them (one list per step)."""

    def __init__(self, block_size: int, medium: str):
        self.block_size = block_size
        self.medium = medium
        self._events: KVEventsList = []

    def stored(self, hashes: list[BlockHash], contents: list[BlockContent]) -> None:
        """Blocks that entered the cache together: one event per run of consecutive blocks."""
        start = 0
        for i in range(1, len(hashes) + 1):
            if i == len(hashes) or contents[i].parent_hash != hashes[i - 1]:
                self._store_run(hashes[start:i], contents[start:i])
                start = i

    def _store_run(self, hashes: list[BlockHash], contents: list[BlockContent]) -> None:
        parent = contents[0].parent_hash
        tokens = [t for content in contents for t in content.token_ids]
        self._events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None if parent == ROOT_HASH else parent,
                token_ids=tokens,
                block_size=self.block_size,
                lora_id=None,
                medium=self.medium,
            )
        )

    def removed(self, block_hash: BlockHash) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)  # one event per run of evictions
        else:
            self._events.append(BlockRemoved(block_hashes=[block_hash], medium=self.medium))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> KVEventsList:
        events, self._events = self._events, []
        return events
