"""Page-aware block allocation for elastic KV memory: the block pool alone, no model."""

from __future__ import annotations

from kvferry.kv.pages import PageChanges, page_runs
from kvferry.scheduler.block_pool import BlockPool, KVCacheBlock
from kvferry.scheduler.hashing import ROOT_HASH, BlockContent, hash_block_tokens

PER_PAGE = 4


def elastic_pool(num_blocks: int = 16, caching: bool = True, null: bool = False) -> BlockPool:
    pool = BlockPool(num_blocks, caching, reserve_null_block=null, blocks_per_page=PER_PAGE)
    assert pool.take_page_changes().full_sync  # the first changes sync everything
    return pool


def pages_of(blocks: list[KVCacheBlock]) -> set[int]:
    return {b.block_id // PER_PAGE for b in blocks}


def cache(pool: BlockPool, block: KVCacheBlock, token: int) -> None:
    tokens = (token,)
    h = hash_block_tokens(ROOT_HASH, tokens)
    pool.cache_full_blocks([block], [h], [BlockContent(ROOT_HASH, tokens)])


def assert_balanced(pool: BlockPool) -> None:
    """Free blocks plus blocks in use is the budget; the pinned pages are the mapped ones."""
    in_use = sum(1 for b in pool.blocks if b.ref_cnt > 0 and not b.is_null)
    assert pool.num_free_blocks + in_use == pool.num_blocks
    pinned = {b.block_id // PER_PAGE for b in pool.blocks if b.ref_cnt > 0 or b.block_hash or b.is_null}
    assert {p for p, n in enumerate(pool.pages.pins) if n} == pinned


def test_blocks_fill_a_mapped_page_before_the_next_is_mapped():
    pool = elastic_pool()
    first = pool.get_new_blocks(3)
    assert pages_of(first) == {0}
    assert pool.take_page_changes() == PageChanges(mapped=(0,))
    more = pool.get_new_blocks(2)
    assert pages_of(more) == {0, 1}  # the last spare block of page 0, then page 1
    assert pool.take_page_changes() == PageChanges(mapped=(1,))
    assert_balanced(pool)


def test_a_page_is_returned_when_its_last_block_is_freed():
    pool = elastic_pool(caching=False)
    blocks = pool.get_new_blocks(8)
    pool.take_page_changes()
    pool.free_blocks(blocks[:3])  # page 0 keeps one block
    assert not pool.has_page_changes()
    assert pool.take_page_changes() == PageChanges()
    pool.free_blocks(blocks[3:4])
    assert pool.has_page_changes()
    assert pool.take_page_changes() == PageChanges(unmapped=(0,))
    pool.free_blocks(blocks[4:])
    assert pool.take_page_changes() == PageChanges(unmapped=(1,))
    assert (pool.pages.pages_mapped_total, pool.pages.pages_returned_total) == (2, 2)
    assert pool.num_free_blocks == pool.num_blocks
    assert_balanced(pool)


def test_free_then_reuse_in_one_step_reports_nothing():
    pool = elastic_pool(caching=False)
    blocks = pool.get_new_blocks(2)
    pool.take_page_changes()
    pool.free_blocks(blocks)
    again = pool.get_new_blocks(1)
    assert pages_of(again) == {0}
    assert not pool.has_page_changes()
    assert pool.take_page_changes() == PageChanges()


def test_fragmented_pages_are_filled_before_a_fresh_one():
    pool = elastic_pool(caching=False)
    blocks = pool.get_new_blocks(12)  # pages 0, 1, 2
    pool.free_blocks([blocks[1], blocks[6], blocks[11]])  # one hole in each page
    pool.take_page_changes()
    refill = pool.get_new_blocks(3)
    assert pages_of(refill) == {0, 1, 2}
    assert pool.take_page_changes() == PageChanges()  # no page mapped for them
    assert_balanced(pool)


def test_cached_blocks_keep_their_page_until_the_cache_is_reset():
    pool = elastic_pool()
    blocks = pool.get_new_blocks(4)
    for i, block in enumerate(blocks):
        cache(pool, block, i)
    pool.take_page_changes()
    pool.free_blocks(blocks)
    assert pool.take_page_changes() == PageChanges()  # cached prefixes stay mapped
    assert pool.num_free_blocks == pool.num_blocks  # ... and still count as free
    assert pool.reset_prefix_cache()
    assert pool.take_page_changes() == PageChanges(unmapped=(0,))
    assert_balanced(pool)


def test_spare_blocks_go_before_a_cached_block_is_evicted():
    pool = elastic_pool(num_blocks=8)
    cached = pool.get_new_blocks(2)
    for i, block in enumerate(cached):
        cache(pool, block, i)
    pool.free_blocks(cached)
    taken = pool.get_new_blocks(6)  # every spare block: page 0's two, then page 1
    assert not {b.block_id for b in taken} & {b.block_id for b in cached}
    assert pool.num_cached_blocks == 2
    evicted = pool.get_new_blocks(1)  # nothing spare is left: the LRU cached block goes
    assert evicted[0] is cached[0] and pool.num_cached_blocks == 1
    assert_balanced(pool)


def test_a_cache_hit_on_a_free_block_pins_nothing_new():
    pool = elastic_pool()
    block = pool.get_new_blocks(1)[0]
    cache(pool, block, 7)
    pool.free_blocks([block])
    pool.take_page_changes()
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.take_page_changes() == PageChanges()
    pool.free_blocks([block])
    assert_balanced(pool)


def test_the_null_blocks_page_stays_mapped():
    pool = BlockPool(16, True, reserve_null_block=True, blocks_per_page=PER_PAGE)
    assert pool.take_page_changes() == PageChanges(mapped=(0,), full_sync=True)
    blocks = pool.get_new_blocks(3)
    assert pages_of(blocks) == {0}  # beside the null block: no new page
    pool.free_blocks(blocks)
    assert pool.take_page_changes() == PageChanges()
    assert_balanced(pool)


def test_ids_past_the_budget_in_the_last_page_are_never_handed_out():
    pool = elastic_pool(num_blocks=10)  # pages 0-2; ids 10 and 11 are reserve only
    blocks = pool.get_new_blocks(10)
    assert max(b.block_id for b in blocks) == 9
    assert pool.num_free_blocks == 0
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 10
    assert_balanced(pool)


def test_eager_pools_report_no_pages():
    pool = BlockPool(8, True)
    pool.get_new_blocks(3)
    assert pool.take_page_changes() is None and not pool.has_page_changes()


def test_page_runs():
    assert list(page_runs([5, 1, 2, 3, 9, 10])) == [(1, 3), (5, 1), (9, 2)]
    assert list(page_runs([])) == []
