"""The KV memory pool shared by a host's engines: its ledger, block pools drawing pages from
it, and a killed engine's bytes coming back. No model."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from kvferry.errors import ConfigError
from kvferry.kv.shared_pool import KVPoolSpec, PoolPageBudget, SharedKVPool, pool_size_bytes
from kvferry.scheduler.block_pool import BlockPool
from kvferry.scheduler.hashing import ROOT_HASH, BlockContent, hash_block_tokens

PER_PAGE = 4
PAGE = 4096  # bytes one page of block ids commits (all ranks)


@pytest.fixture
def pool_name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    KVPoolSpec(name).path.unlink(missing_ok=True)


def engine_pool(name: str, num_blocks: int = 32, size: int | None = 4 * PAGE) -> BlockPool:
    """One engine's block pool on the shared pool `name` (created with `size` bytes)."""
    budget = PoolPageBudget(SharedKVPool(KVPoolSpec(name, size)), PAGE)
    pool = BlockPool(num_blocks, False, blocks_per_page=PER_PAGE, page_budget=budget)
    pool.take_page_changes()
    return pool


def allocate(pool: BlockPool, num_blocks: int) -> list:
    """What the KV cache manager does: grants first, then the blocks."""
    if not pool.can_allocate(num_blocks):
        return []
    blocks = pool.get_new_blocks(num_blocks)
    pool.settle()
    return blocks


def held(pool: BlockPool) -> int:
    return pool.budget.pool.held_bytes()


def test_two_engines_share_the_pages_of_one_budget(pool_name):
    first, second = engine_pool(pool_name), engine_pool(pool_name, size=None)
    a = allocate(first, 12)  # 3 of the 4 pages
    assert len(a) == 12 and held(first) == 3 * PAGE
    assert first.num_free_blocks == second.num_free_blocks == PER_PAGE  # the pool's last page
    assert allocate(second, 5) == []  # 2 pages: the pool has 1 left; nothing taken
    assert held(second) == 0
    b = allocate(second, 4)
    assert len(b) == 4 and held(second) == PAGE
    assert allocate(first, 1) == [] and allocate(second, 1) == []  # the pool is full
    assert first.take_page_changes().mapped == (0, 1, 2)  # a step: the workers map them
    first.free_blocks(a)
    assert held(first) == 3 * PAGE  # returned pages go back once the workers are told ...
    assert first.take_page_changes().unmapped == (0, 1, 2)
    assert held(first) == 0  # ... and then the other engine can grow
    assert len(allocate(second, 12)) == 12 and held(second) == 4 * PAGE


def test_blocks_freed_before_the_workers_heard_of_them_give_their_grant_back(pool_name):
    pool = engine_pool(pool_name)
    blocks = allocate(pool, 8)
    pool.free_blocks(blocks)  # within one step: never mapped by a worker
    assert held(pool) == 0 and pool.take_page_changes().is_empty


def test_a_shared_pool_engine_evicts_its_own_cache_before_growing(pool_name):
    budget = PoolPageBudget(SharedKVPool(KVPoolSpec(pool_name, 4 * PAGE)), PAGE)
    pool = BlockPool(32, True, blocks_per_page=PER_PAGE, page_budget=budget)
    pool.take_page_changes()
    blocks = allocate(pool, 2)
    for i, block in enumerate(blocks):
        tokens = (i,)
        pool.cache_full_blocks(
            [block], [hash_block_tokens(ROOT_HASH, tokens)], [BlockContent(ROOT_HASH, tokens)]
        )
    pool.free_blocks(blocks)
    again = allocate(pool, 4)  # 2 spare blocks of page 0, then the 2 cached ones: no new page
    assert {b.block_id for b in again} == {0, 1, 2, 3} and held(pool) == PAGE


def test_pool_size_must_agree_and_a_missing_pool_needs_one(pool_name):
    with pytest.raises(ConfigError, match="does not exist"):
        pool_size_bytes(KVPoolSpec(pool_name))
    with pytest.raises(ConfigError, match="does not exist"):
        SharedKVPool(KVPoolSpec(pool_name))
    pool = SharedKVPool(KVPoolSpec(pool_name, 8 * PAGE))
    assert pool_size_bytes(KVPoolSpec(pool_name)) == 8 * PAGE
    with pytest.raises(ConfigError, match="holds 32768 bytes"):
        SharedKVPool(KVPoolSpec(pool_name, 4 * PAGE))
    pool.close()
    with pytest.raises(ConfigError, match="letters"):
        KVPoolSpec("../etc")


_HOLDER = """
import sys, time
from kvferry.kv.shared_pool import KVPoolSpec, SharedKVPool
pool = SharedKVPool(KVPoolSpec(sys.argv[1]))
assert pool.try_take(int(sys.argv[2]))
print("holding", flush=True)
time.sleep(60)
"""


def test_a_killed_engines_bytes_return_to_the_pool(pool_name):
    pool = SharedKVPool(KVPoolSpec(pool_name, 8 * PAGE))
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, pool_name, str(6 * PAGE)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "holding"
        assert pool.used_bytes() == 6 * PAGE and not pool.try_take(4 * PAGE)
        child.kill()  # SIGKILL: no chance to give anything back
        child.wait(timeout=10)
        assert pool.try_take(8 * PAGE)  # the dead engine's slot was reclaimed
        assert pool.used_bytes() == 8 * PAGE
    finally:
        child.kill()
        pool.close()


def _config(pool: KVPoolSpec, **cache: object):  # noqa: ANN202 - KVCacheConfig
    from types import SimpleNamespace

    import torch

    from kvferry.config import CacheConfig
    from kvferry.kv.allocate import build_kv_cache_config
    from kvferry.kv.spec import AttentionLayerKV

    layers = [AttentionLayerKV(f"l{i}", 2, 32) for i in range(2)]  # 8 KiB per block and layer
    config = CacheConfig(kv_allocator="elastic", kv_memory_pool=pool, **cache)
    return build_kv_cache_config(SimpleNamespace(dtype=torch.float32), config, layers, 1 << 20, num_ranks=2)


def test_an_engine_on_a_pool_may_grow_to_all_of_it_unless_asked_for_less(pool_name):
    pool = KVPoolSpec(pool_name, (64 << 20) + 40000)  # 1.2 blocks over: whole pages only
    whole = _config(pool)  # the 1 MiB fraction budget does not bind it: the pool does
    block_bytes = 2 * 8192 * 2  # two layers, two TP ranks
    assert whole.num_blocks == (64 << 20) // block_bytes and whole.pool_page_bytes == block_bytes * 2
    assert whole.num_blocks % whole.blocks_per_page == 0
    assert _config(pool, kv_cache_bytes=1 << 20).num_blocks == 64  # asked: 1 MiB / 16 KiB per rank
    assert _config(pool, num_gpu_blocks_override=1 << 20).num_blocks == whole.num_blocks  # capped
