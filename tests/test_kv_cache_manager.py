"""KVCacheManager over one BlockPool: allocation, prefix hits, caching, freeing. No model."""

from __future__ import annotations

import pytest
import torch

from kvferry.kv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    Layout,
    SlidingWindowSpec,
)
from kvferry.sampling_params import SamplingParams
from kvferry.scheduler import hashing
from kvferry.scheduler.kv_cache_manager import KVCacheManager
from kvferry.scheduler.request import Request

BLOCK = 4


def make_kv_config(
    num_blocks: int, block_size: int = BLOCK, specs: tuple[KVCacheSpec, ...] = ()
) -> KVCacheConfig:
    specs = specs or (FullAttentionSpec(block_size, 2, 8, torch.float32),)
    groups = tuple(KVCacheGroup(spec, (f"layers.{i}",)) for i, spec in enumerate(specs))
    return KVCacheConfig(groups, (), Layout.NHD, num_blocks, num_blocks)


def make_manager(num_blocks: int = 16, caching: bool = True, **kw) -> KVCacheManager:
    return KVCacheManager(make_kv_config(num_blocks, **kw), enable_prefix_caching=caching)


def make_request(kv: KVCacheManager, req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(), [0], max_model_len=1024, block_hasher=kv.block_hasher)


def run_prefill(kv: KVCacheManager, req: Request) -> int:
    """Admit like the scheduler does, compute the whole prompt, cache its full blocks."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req, req.num_computed_tokens)
    return num_hit


def pool_state(kv: KVCacheManager) -> tuple:
    pool = kv.pool
    return (
        [b.block_id for b in pool.free_queue],
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        dict(pool.cached),
    )


def test_allocate_grows_block_tables_and_free_returns_everything():
    kv = make_manager(8)
    req = make_request(kv, "a", list(range(10)))
    new = kv.allocate_slots(req, 10)
    assert new == ([0, 1, 2],)
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 1) == ([],)  # the 11th token fits in block 2
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 1) == ([3],)
    assert kv.get_block_ids("a") == ([0, 1, 2, 3],)
    assert kv.num_free_blocks == 4 and kv.usage == pytest.approx(0.5)
    kv.free(req)
    assert kv.num_free_blocks == kv.num_blocks == 8
    assert kv.get_block_ids("a") == ([],)


def test_prefix_hit_shares_blocks_and_counts_references():
    kv = make_manager(16)
    a = make_request(kv, "a", list(range(13)))  # 3 full blocks + 1 token
    assert run_prefill(kv, a) == 0
    b = make_request(kv, "b", list(range(12)) + [99, 98])
    assert run_prefill(kv, b) == 12
    shared = kv.get_block_ids("a")[0][:3]
    assert kv.get_block_ids("b")[0][:3] == shared
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [2, 2, 2]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [1, 1, 1]
    kv.free(b)
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.pool.num_cached_blocks == 3  # freed blocks stay cached


def test_never_the_whole_prompt():
    kv = make_manager(16)
    a = make_request(kv, "a", list(range(8)))  # exactly two blocks
    run_prefill(kv, a)
    b = make_request(kv, "b", list(range(8)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4 and len(hits[0]) == 1  # the last block is recomputed for logits
    kv.free(a)


def test_only_full_computed_blocks_are_cached():
    kv = make_manager(16)
    a = make_request(kv, "a", list(range(12)))
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 6
    kv.cache_blocks(a, 6)
    assert kv.pool.num_cached_blocks == 1
    b = make_request(kv, "b", list(range(12)))
    assert kv.get_computed_blocks(b)[1] == 4
    a.num_computed_tokens = 12
    kv.cache_blocks(a, 12)
    assert kv.get_computed_blocks(b)[1] == 8
    kv.free(a)


def test_tail_of_a_freed_prefix_is_evicted_first():
    kv = make_manager(4)
    a = make_request(kv, "a", list(range(13)))  # 4 blocks
    run_prefill(kv, a)
    kv.free(a)
    # A new request takes one block: the LRU head is a's last block, so a's prefix survives.
    c = make_request(kv, "c", [50, 51])
    kv.allocate_slots(c, 2)
    assert kv.get_block_ids("c") == ([3],)
    again = make_request(kv, "a2", list(range(13)))
    assert kv.get_computed_blocks(again)[1] == 12
    kv.free(c)


def test_failed_allocation_changes_nothing():
    kv = make_manager(6)
    a = make_request(kv, "a", list(range(9)))
    run_prefill(kv, a)  # 3 blocks, 2 cached
    kv.free(a)
    hog = make_request(kv, "hog", [7] * 8)
    kv.allocate_slots(hog, 8)  # 2 blocks taken; 4 free, 2 of them cached hits
    before = pool_state(kv)
    b = make_request(kv, "b", list(range(8)) + [5] * 12)  # hits 8 tokens, needs 5 blocks in all
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, 12, hits) is None
    assert pool_state(kv) == before
    assert kv.get_block_ids("b") == ([],)
    kv.free(hog)
    assert kv.num_free_blocks == kv.num_blocks


def test_evictable_hits_count_against_free_blocks():
    kv = make_manager(3)
    a = make_request(kv, "a", list(range(9)))
    run_prefill(kv, a)
    cached_ids = kv.get_block_ids("a")[0][:2]
    kv.free(a)  # 3 free blocks, 2 of them cached
    b = make_request(kv, "b", list(range(8)) + [1, 2, 3, 4, 5])  # 2 hit blocks + 2 new: 4 > 3
    hits, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 5, hits) is None
    c = make_request(kv, "c", list(range(8)) + [1])  # 2 hits + 1 new
    hits, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 8
    assert kv.allocate_slots(c, 1, hits) is not None
    assert kv.get_block_ids("c")[0][:2] == cached_ids
    kv.free(c)
    assert kv.num_free_blocks == 3


def test_hash_collision_never_serves_wrong_kv(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(hashing, "hash_bytes", lambda data: b"collide")
    kv = make_manager(16)
    a = make_request(kv, "a", list(range(12)))
    run_prefill(kv, a)
    assert len(set(a.block_hashes)) == 1  # every block has the same hash
    other = make_request(kv, "b", [9] * 12)
    assert kv.get_computed_blocks(other)[1] == 0
    same = make_request(kv, "c", list(range(12)))
    # Block 0 is cached under the shared hash; block 1's content differs from it: a miss.
    assert kv.get_computed_blocks(same)[1] == 4
    assert kv.pool.num_collisions >= 2
    kv.free(a)


def test_caching_disabled():
    kv = make_manager(8, caching=False)
    a = make_request(kv, "a", list(range(9)))
    assert a.block_hashes == []
    run_prefill(kv, a)
    b = make_request(kv, "b", list(range(9)))
    assert kv.get_computed_blocks(b) == (([],), 0)
    kv.free(a)
    assert kv.num_free_blocks == 8


def test_reset_prefix_cache():
    kv = make_manager(8)
    a = make_request(kv, "a", list(range(9)))
    run_prefill(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request(kv, "b", list(range(9))))[1] == 0


def test_one_pool_serves_full_and_sliding_window_groups():
    full = FullAttentionSpec(BLOCK, 2, 8, torch.float32)
    window = SlidingWindowSpec(BLOCK, 2, 8, torch.float32, sliding_window=6)
    kv = make_manager(32, specs=(full, window))
    assert kv.num_blocks == 31  # block 0 is the null block
    a = make_request(kv, "a", list(range(20)))
    # A hit at token 16 sees 11 on: the window group gets no blocks before block 2 (the
    # chunk's own keys come from the step; its positions 0..7 go to the null block).
    assert kv.allocate_slots(a, 20) == ([1, 2, 3, 4, 5], [0, 0, 6, 7, 8])
    a.num_computed_tokens = 20
    kv.cache_blocks(a, 20)
    assert kv.allocate_slots(a, 1) == ([9], [10])
    # Token 20 attends to 15..20: window block 2 is replaced by the null block.
    full_ids, window_ids = kv.get_block_ids("a")
    assert full_ids == [1, 2, 3, 4, 5, 9] and window_ids == [0, 0, 0, 7, 8, 10]
    b = make_request(kv, "b", list(range(20)) + [7])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 20
    assert [blk.block_id for blk in hits[1]] == [0, 0, 0, 7, 8]  # only the window is needed
    assert kv.allocate_slots(b, 1, hits) is not None
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == kv.num_blocks


def test_can_fit():
    kv = make_manager(4)
    assert kv.can_fit(16) and not kv.can_fit(17)


def test_a_sliding_window_group_holds_two_windows_however_long_the_chunked_prompt():
    full = FullAttentionSpec(BLOCK, 2, 8, torch.float32)
    window = SlidingWindowSpec(BLOCK, 2, 8, torch.float32, sliding_window=10)
    kv = make_manager(128, specs=(full, window))
    a = make_request(kv, "a", list(range(200)))
    held_window = []
    while a.num_computed_tokens < 200:
        num = min(32, 200 - a.num_computed_tokens)
        assert kv.allocate_slots(a, num) is not None
        a.num_computed_tokens += num
        kv.cache_blocks(a, a.num_computed_tokens)
        full_ids, window_ids = kv.get_block_ids("a")
        assert len(full_ids) == len(window_ids) == -(-a.num_computed_tokens // BLOCK)
        held_window.append(sum(1 for b in window_ids if b != 0))
    # chunks of 32 with a 10-token window: at most the window before a chunk and after it
    assert max(held_window) <= 2 * (-(-9 // BLOCK)) + 3 and held_window[-1] <= 5
    assert kv.num_free_blocks == kv.num_blocks - 50 - held_window[-1]  # freed during the request
    kv.free(a)
    assert kv.num_free_blocks == kv.num_blocks
