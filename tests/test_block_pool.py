"""BlockPool, free queue and block hashing: no model, no scheduler."""

from __future__ import annotations

import pytest

from kvferry.kv.null_block import (
    NO_NULL_BLOCK,
    NULL_BLOCK_ID,
    null_block_id,
    reserves_null_block,
    usable_block_ids,
)
from kvferry.sampling_params import SamplingParams
from kvferry.scheduler import hashing
from kvferry.scheduler.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from kvferry.scheduler.hashing import ROOT_HASH, BlockContent, BlockHasher, hash_block_tokens
from kvferry.scheduler.request import Request


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def content(tokens: tuple[int, ...], parent: bytes = ROOT_HASH) -> BlockContent:
    return BlockContent(parent, tokens)


def cache(pool: BlockPool, block: KVCacheBlock, tokens: tuple[int, ...], parent: bytes = ROOT_HASH) -> bytes:
    h = hash_block_tokens(parent, tokens)
    pool.cache_full_blocks([block], [h], [content(tokens, parent)])
    return h


def test_free_queue_is_a_doubly_linked_list():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])  # from the middle
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2]
    assert len(queue) == 4
    for _ in range(4):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()


def test_new_blocks_come_from_the_head_with_one_reference():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1  # a failed request takes nothing
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == pool.num_blocks == 4


def test_freed_blocks_join_the_tail_in_the_given_order():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(3)  # 0 1 2
    assert free_ids(pool) == [3, 4, 5]
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]


def test_lru_eviction_of_cached_blocks():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = [cache(pool, b, (i, i)) for i, b in enumerate(blocks)]
    pool.free_blocks([blocks[1], blocks[0], blocks[2]])  # 1 least recently freed
    assert pool.num_cached_blocks == 3
    # Still cached while free: a hit.
    assert pool.get_cached_block(hashes[0], content((0, 0))) is blocks[0]
    # Reuse evicts from the head: block 1 first, then 0.
    (first,) = pool.get_new_blocks(1)
    assert first is blocks[1] and first.block_hash is None
    assert pool.get_cached_block(hashes[1], content((1, 1))) is None
    assert pool.get_cached_block(hashes[0], content((0, 0))) is blocks[0]
    (second,) = pool.get_new_blocks(1)
    assert second is blocks[0]
    assert pool.num_cached_blocks == 1
    pool.free_blocks([first, second])
    assert pool.num_free_blocks == 3


def test_touch_takes_a_cached_free_block_out_of_the_middle():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    h = cache(pool, blocks[2], (7, 8))
    pool.free_blocks(blocks)
    hit = pool.get_cached_block(h, content((7, 8)))
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert free_ids(pool) == [0, 1, 3]
    pool.touch([hit])  # a second user: no queue change
    assert hit.ref_cnt == 2
    pool.free_blocks([hit])
    assert free_ids(pool) == [0, 1, 3]
    pool.free_blocks([hit])
    assert free_ids(pool) == [0, 1, 3, 2]
    with pytest.raises(AssertionError):
        pool.free_blocks([hit])  # double free


def test_collision_check_compares_content():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    h = cache(pool, block, (1, 2))
    # Same hash, other tokens (a forged collision): a miss, never the wrong KV.
    assert pool.get_cached_block(h, content((9, 9))) is None
    assert pool.get_cached_block(h, content((1, 2), parent=b"other")) is None
    assert pool.num_collisions == 2
    assert pool.get_cached_block(h, content((1, 2))) is block
    # Another group with the same hash is a different cache entry.
    assert pool.get_cached_block(h, content((1, 2)), group_id=1) is None
    pool.free_blocks([block])


def test_duplicate_blocks_stay_private():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = cache(pool, a, (1, 2))
    cache(pool, b, (1, 2))
    assert b.block_hash is None and pool.get_cached_block(h, content((1, 2))) is a
    pool.free_blocks([a, b])


def test_no_caching_when_disabled():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    h = cache(pool, block, (1, 2))
    assert pool.get_cached_block(h, content((1, 2))) is None
    pool.free_blocks([block])


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    h = cache(pool, block, (1, 2))
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h, content((1, 2))) is None
    assert block.block_hash is None and pool.num_free_blocks == 2


def test_null_block_is_reserved():
    pool = BlockPool(4, enable_caching=True, reserve_null_block=True)
    assert pool.num_blocks == 3 and pool.null_block is pool.blocks[0]
    blocks = pool.get_new_blocks(3)
    assert 0 not in [b.block_id for b in blocks]
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block, *blocks])
    assert pool.num_free_blocks == 3 and pool.null_block.ref_cnt == 0


def test_hashes_chain_through_parents():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert h1 == hash_block_tokens(ROOT_HASH, (1, 2, 3))
    assert len(h1) == 32
    h2 = hash_block_tokens(h1, [4, 5, 6])
    other_parent = hash_block_tokens(None, [9, 2, 3])
    assert hash_block_tokens(other_parent, [4, 5, 6]) != h2  # same tokens, other prefix
    assert hash_block_tokens(h1, [4, 5, 6], extra_keys=("salt",)) != h2


def test_hasher_is_incremental():
    hasher = BlockHasher(block_size=4)
    req = Request("r", list(range(10)), SamplingParams(), [0], max_model_len=64, block_hasher=hasher)
    expected = [hash_block_tokens(None, [0, 1, 2, 3])]
    expected.append(hash_block_tokens(expected[0], [4, 5, 6, 7]))
    assert req.block_hashes == expected  # the partial block (8, 9) has no hash
    req.append_output_token_ids(10)
    assert len(req.block_hashes) == 2
    req.append_output_token_ids([11, 12])
    assert req.block_hashes[2] == hash_block_tokens(expected[1], [8, 9, 10, 11])
    assert hasher.content(req, 2) == BlockContent(expected[1], (8, 9, 10, 11))


def test_hash_function_is_swappable(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(hashing, "hash_bytes", lambda data: b"same")
    assert hash_block_tokens(None, [1]) == hash_block_tokens(None, [2]) == b"same"


def test_the_null_block_rule_is_stated_once_and_shared_with_the_nixl_checks():
    from kvferry.connector.nixl.protocol import GroupInfo, GroupKind
    from kvferry.connector.nixl.validate import null_block

    assert reserves_null_block(True) and not reserves_null_block(False)
    assert null_block_id(True) == NULL_BLOCK_ID == 0 and null_block_id(False) == NO_NULL_BLOCK
    assert usable_block_ids(4, has_sliding_window=True) == [1, 2, 3]
    assert usable_block_ids(4, has_sliding_window=False) == [0, 1, 2, 3]
    pool = BlockPool(4, enable_caching=False, reserve_null_block=True)
    assert [b.block_id for b in pool.get_new_blocks(3)] == usable_block_ids(4, True)
    full = GroupInfo(GroupKind.FULL, 16, 2, 8, "float32", 0, ["l0"])
    sliding = GroupInfo(GroupKind.SLIDING, 16, 2, 8, "float32", 32, ["l1"])
    assert null_block([full]) == NO_NULL_BLOCK
    assert null_block([full, sliding]) == NULL_BLOCK_ID
