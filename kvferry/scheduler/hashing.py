"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its token ids and optional extra keys (a
salt, adapter or multimodal ids later), so equal hashes mean equal prefixes. The hash is
sha256 over a msgpack encoding: deterministic across processes, so instances and
connectors (offload, P/D) can agree on block identities.

The hash is never trusted alone: the block pool keeps each cached block's `BlockContent`
and a hit must match it (collision check).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from kvferry.scheduler.request import Request

logger = logging.getLogger(__name__)

BlockHash = bytes
HashFn = Callable[[bytes], bytes]

# Parent hash of a request's first block: a fixed seed, the same in every process.
ROOT_HASH: BlockHash = hashlib.sha256(b"kvferry-prefix-cache-root").digest()


def hash_bytes(data: bytes) -> BlockHash:
    """The hash function behind block hashes (tests monkeypatch it to force collisions)."""
    return hashlib.sha256(data).digest()


@dataclass(frozen=True, slots=True)
class BlockContent:
    """What a block hash stands for; compared on every cache hit."""

    parent_hash: BlockHash
    token_ids: tuple[int, ...]
    extra_keys: tuple[object, ...] | None = None

    def encode(self) -> bytes:
        return msgspec.msgpack.encode((self.parent_hash, self.token_ids, self.extra_keys))


def hash_block(content: BlockContent, hash_fn: HashFn | None = None) -> BlockHash:
    fn = hash_fn if hash_fn is not None else hash_bytes
    return fn(content.encode())


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
    hash_fn: HashFn | None = None,
) -> BlockHash:
    """Hash of one block given its parent's hash (None for the first block)."""
    parent = ROOT_HASH if parent_hash is None else parent_hash
    return hash_block(BlockContent(parent, tuple(token_ids), extra_keys), hash_fn)


class BlockHasher:
    """Computes a request's block hashes incrementally, as its blocks become full.

    One hasher per scheduler (all groups share the block size, so they share hashes).
    `extra_keys` is the seam for salts/adapters: it must be a pure function of the
    request and the block's token range.
    """

    def __init__(self, block_size: int, hash_fn: HashFn | None = None):
        assert block_size > 0
        self.block_size = block_size
        self._hash_fn = hash_fn

    def extra_keys(self, request: Request, start: int, end: int) -> tuple[object, ...] | None:
        return None

    def content(self, request: Request, index: int) -> BlockContent:
        """The content of the request's full block `index` (its hash must already exist)."""
        start = index * self.block_size
        end = start + self.block_size
        assert end <= request.num_tokens, "only full blocks have content"
        parent = ROOT_HASH if index == 0 else request.block_hashes[index - 1]
        tokens = tuple(request.all_token_ids[start:end])
        return BlockContent(parent, tokens, self.extra_keys(request, start, end))

    def update(self, request: Request) -> None:
        """Append the hashes of the request's blocks that became full since the last call."""
        hashes = request.block_hashes
        while (len(hashes) + 1) * self.block_size <= request.num_tokens:
            hashes.append(hash_block(self.content(request, len(hashes)), self._hash_fn))
