"""The KV memory pool shared by a host's engines: its ledger, block pools drawing pages from
it, and a killed engine's bytes coming back. No model."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

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


_RACER = """
import random, sys, time
from kvferry.kv.shared_pool import KVPoolSpec, SharedKVPool
pool = SharedKVPool(KVPoolSpec(sys.argv[1]))
page, rounds, rng = int(sys.argv[2]), int(sys.argv[3]), random.Random(sys.argv[4])
print("ready", flush=True)
sys.stdin.readline()  # both start at once
for _ in range(rounds):
    pages = rng.randint(1, 3)
    if not pool.try_take(pages * page):
        print("refused", pages)
        continue
    start = time.monotonic_ns()  # within the grant: after the take, before the give
    time.sleep(rng.choice((0, 0, 0.0002)))
    end = time.monotonic_ns()
    pool.give(pages * page)
    print("grant", pages, start, end)
pool.close()
print("done", flush=True)
"""
RACE_PAGES = 4  # two racers asking 1-3 pages each: often one must wait for the other's


@dataclass(frozen=True)
class Grant:
    pages: int
    start: int  # monotonic ns, system-wide: comparable across processes
    end: int


def _grants(log: str) -> tuple[list[Grant], int]:
    """A racer's grants and how many times it was refused (from its output after "ready")."""
    lines = [line.split() for line in log.splitlines()]
    assert lines[-1] == ["done"], log[-2000:]
    grants = [Grant(*map(int, line[1:])) for line in lines if line[0] == "grant"]
    return grants, sum(line[0] == "refused" for line in lines)


def _most_granted_at_once(grants: list[Grant]) -> int:
    """The most pages granted at one instant over all racers (a sweep over the intervals;
    at a tie an end comes before a start: the give happened before the other's take)."""
    events = sorted([(g.start, 1, g.pages) for g in grants] + [(g.end, 0, -g.pages) for g in grants])
    most = held = 0
    for _, _, pages in events:
        held += pages
        most = max(most, held)
    return most


def _observe(observer: SharedKVPool, stop: threading.Event, seen: list[int]) -> None:
    """A third process's view: the pool's total held bytes, read under the ledger's lock."""
    with open(observer.spec.path, "rb") as ledger:
        while not stop.is_set():
            fcntl.flock(ledger, fcntl.LOCK_EX)
            try:
                seen.append(observer.used_bytes())
            finally:
                fcntl.flock(ledger, fcntl.LOCK_UN)
            stop.wait(0.0005)  # leave the racers the lock most of the time


def test_two_processes_racing_for_the_last_pages_never_get_more_than_the_pool(pool_name):
    """Two processes take and give back grants of 1-3 pages of a 4-page pool as fast as they
    can: the ledger never grants more than the pool (seen by an observer under the lock, and
    from the racers' own grant intervals), both get pages and both are refused sometimes,
    neither fails, and the pool ends empty."""
    observer = SharedKVPool(KVPoolSpec(pool_name, RACE_PAGES * PAGE))
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, pool_name, str(PAGE), "1500", str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=_observe, args=(observer, stop, seen))
    try:
        assert [r.stdout.readline() for r in racers] == ["ready\n"] * 2
        watcher.start()
        for racer in racers:
            racer.stdin.write("go\n")
            racer.stdin.flush()
        outputs = [r.communicate(timeout=30) for r in racers]
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        for racer in racers:
            racer.kill()
    assert [r.returncode for r in racers] == [0, 0], [err for _, err in outputs]
    logs = [_grants(out) for out, _ in outputs]
    assert all(grants and refused for grants, refused in logs)  # each got pages, each waited
    assert _most_granted_at_once([g for grants, _ in logs for g in grants]) <= RACE_PAGES
    assert max(seen) <= RACE_PAGES * PAGE and any(0 < s for s in seen)
    assert observer.used_bytes() == 0  # every grant given back, every racer gone
    observer.close()


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
