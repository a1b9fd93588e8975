"""Offload pieces without a model: index LRU across tiers, config checks, slot tags, copies."""

import threading

import pytest
import torch

from kvferry.config import KVTransferConfig
from kvferry.connector.offload.blocks import BlockCopier
from kvferry.connector.offload.config import (
    OffloadConfig,
    instance_block_bytes,
    slot_bytes_per_rank,
    tier_owner,
)
from kvferry.connector.offload.index import TierIndex
from kvferry.connector.offload.jobs import JobQueue
from kvferry.connector.offload.metadata import DemoteOp, OffloadMetadata, SaveOp, Tier
from kvferry.connector.offload.tiers import DiskTier, DramTier, Tag, payload_crc
from kvferry.connector.offload.worker_side import OffloadWorker
from kvferry.errors import ConfigError
from kvferry.kv.allocate import allocate_kv_caches
from kvferry.kv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    Layout,
    SlidingWindowSpec,
)
from tests.engine_helpers import make_llm


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


# ---- index ------------------------------------------------------------------------------


def test_index_demotes_dram_lru_to_disk_then_drops_disk_lru():
    index = TierIndex(dram_slots=2, disk_slots=2)
    assert index.insert(h(1), 1) == (index.get(h(1)), [])
    index.insert(h(2), 2)
    index.touch(h(1))  # h(2) is now the DRAM LRU
    entry, ops = index.insert(h(3), 3)
    assert ops == [DemoteOp(dram_slot=1, disk_slot=0, block_hash=h(2), epoch=2)]
    assert entry.tier is Tier.DRAM and entry.slot == 1
    assert index.get(h(2)).tier is Tier.DISK
    index.insert(h(4), 4)  # demotes h(1) to disk slot 1
    _, ops = index.insert(h(5), 5)  # disk full: drops h(2), demotes h(3) into its slot
    assert ops == [DemoteOp(1, 0, h(3), 3)]
    assert h(2) not in index and index.num_dropped == 1 and index.num_demoted == 3
    assert [index.num_entries(t) for t in Tier] == [2, 2]


def test_index_without_disk_drops_and_reuses_the_slot():
    index = TierIndex(dram_slots=1, disk_slots=0)
    index.insert(h(1), 1)
    entry, ops = index.insert(h(2), 2)
    assert ops == [] and entry.slot == 0 and h(1) not in index and index.num_dropped == 1


def test_index_disk_only_prefix_count_and_epoch_checked_removal():
    index = TierIndex(dram_slots=0, disk_slots=4)
    for i in range(3):
        assert index.insert(h(i), 10 + i)[0].tier is Tier.DISK
    assert index.count_prefix([h(0), h(1), h(9), h(2)], 0, 4) == 2
    assert index.count_prefix([h(0), h(1), h(2)], 1, 2) == 1  # stop is exclusive
    assert not index.remove(h(1), epoch=99)  # a different save: kept
    assert index.remove(h(1), epoch=11) and index.count_prefix([h(0), h(1)], 0, 2) == 1
    assert index.insert(h(7), 20)[0].slot == 1  # the freed slot is reused


# ---- config -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"dram_gib": -1}, "non-negative"),
        ({"dram_gib": "1"}, "non-negative"),
        ({"dram_gib": True}, "non-negative"),
        ({"dram_blocks": 1.5}, "integer"),
        ({"dram_gib": 1, "dram_blocks": 4}, "not both"),
        ({"disk_gib": 1}, "need a disk_dir"),
        ({"bogus": 1}, "unknown keys"),
        ({"verify_checksum": "yes"}, "true or false"),
    ],
)
def test_bad_extra_config_is_a_config_error(extra, match):
    with pytest.raises(ConfigError, match=match):
        OffloadConfig.from_extra(extra)


def test_disk_config_checks(tmp_path):
    with pytest.raises(ConfigError, match="needs a capacity"):
        OffloadConfig.from_extra({"disk_dir": str(tmp_path)})
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot be created"):
        OffloadConfig.from_extra({"disk_dir": str(blocker / "sub"), "disk_gib": 1})
    config = OffloadConfig.from_extra({"dram_gib": 0, "disk_dir": str(tmp_path / "d"), "disk_gib": 0.5})
    assert (tmp_path / "d").is_dir()
    assert config.num_slots(block_bytes=2 << 20) == (0, 256)
    with pytest.raises(ConfigError, match="hold no block"):
        OffloadConfig.from_extra({"dram_gib": 1e-9}).num_slots(4096)


@pytest.mark.parametrize(
    "local_heads, total_heads, tp, expected_heads",
    [(1, 2, 2, 2), (2, 3, 2, 3), (1, 3, 2, 3), (1, 2, 4, 2), (1, 1, 2, 1)],
)
def test_block_bytes_are_the_same_on_every_rank(local_heads, total_heads, tp, expected_heads):
    """Capacities are per instance: uneven head splits; a replicated head (2 heads over 4
    ranks, a latent-attention cache's one row over 2) counts once, as the tiers store it."""
    spec = FullAttentionSpec(16, local_heads, 64, torch.float32)
    kv = KVCacheConfig(
        (KVCacheGroup(spec, ("a", "b")),), tuple(KVCacheTensor(1, (n,)) for n in "ab"), Layout.NHD, 4, 4
    )
    per_head = 2 * 16 * 64 * 4 * 2  # K and V, 2 layers
    assert instance_block_bytes(kv, total_heads, tp) == per_head * expected_heads


@pytest.mark.parametrize(
    "total_heads, tp, owners",
    [(1, 1, [0]), (1, 2, [0, 0]), (2, 4, [0, 0, 2, 2]), (1, 4, [0, 0, 0, 0]), (4, 2, [0, 1]), (3, 2, [0, 1])],
)
def test_only_the_lowest_rank_holding_a_kv_head_saves_it(tmp_path, total_heads, tp, owners):
    """A replicated KV head (MLA's latent row at TP 2: total 1; GQA with fewer heads than
    ranks) is saved by one rank, the lowest holding it; replicas get no tier and save nothing."""
    assert [tier_owner(r, tp, total_heads) for r in range(tp)] == owners
    local = max(1, total_heads // tp)
    kv = KVCacheConfig(
        (KVCacheGroup(FullAttentionSpec(16, local, 8, torch.float32), ("a",)),),
        (KVCacheTensor(2 * 2 * 16 * local * 8 * 4, ("a",)),),
        Layout.NHD,
        2,
        2,
    )
    config = OffloadConfig.from_extra({"dram_blocks": 4, "disk_dir": str(tmp_path), "disk_blocks": 4})
    for rank in range(tp):
        worker = OffloadWorker(config, kv, total_heads, tp, rank)
        try:
            worker.register({"a": torch.zeros(2, 2, 16, local, 8)}, kv)
            saves = rank == owners[rank]
            assert worker.owns is saves
            assert (worker.dram is not None, worker.disk is not None) == (saves, saves)
            op = SaveOp("r", Tier.DRAM, 0, b"h" * 32, 1, (0,))
            worker.submit_ops(OffloadMetadata(ops=[op], instance_id="i"))
            done = worker.finished_sending({"r"}, idle=True)
            while not done:  # a replica's (empty) job reports the request finished too
                done = worker.finished_sending(set(), idle=True)
            assert done == {"r"}
            assert worker.take_stats().get("offload_bytes_saved", 0) == (
                16 * local * 8 * 4 * 2 if saves else 0
            )
        finally:
            worker.close()


def test_engine_start_up_rejects_bad_offload_config(tiny_llama):
    bad = KVTransferConfig("OffloadConnector", kv_connector_extra_config={"dram_gib": -2})
    for tp in (1, 2):  # checked before any worker starts
        with pytest.raises(ConfigError, match="dram_gib"):
            make_llm(tiny_llama, kv_transfer=bad, tp=tp)


def test_sliding_window_groups_are_accepted_with_one_slot_row_per_block_position():
    """Hybrid allocation: 2 tensors, each serving a layer of both groups: a block position
    holds 4 pages, the full group's first."""
    sliding = SlidingWindowSpec(16, 2, 16, torch.float32, sliding_window=64)
    full = FullAttentionSpec(16, 2, 16, torch.float32)
    kv = KVCacheConfig(
        (KVCacheGroup(sliding, ("s0", "s1")), KVCacheGroup(full, ("f0", "f1"))),
        (
            KVCacheTensor(4 * full.page_size_bytes, ("s0", "f0")),
            KVCacheTensor(4 * full.page_size_bytes, ("s1", "f1")),
        ),
        Layout.NHD,
        4,
        4,
    )
    from kvferry.connector.offload.config import check_kv_cache_config

    check_kv_cache_config(kv)
    assert slot_bytes_per_rank(kv) == instance_block_bytes(kv, 2, 1) == 4 * full.page_size_bytes
    assert instance_block_bytes(kv, 4, 2) == 2 * 4 * full.page_size_bytes  # 2 heads a rank
    wide = FullAttentionSpec(16, 1, 32, torch.float32)  # Gemma 4's global layers: 1 head, twice as wide
    mixed = KVCacheConfig(
        (KVCacheGroup(sliding, ("s0",)), KVCacheGroup(wide, ("f0",))),
        (KVCacheTensor(4 * full.page_size_bytes, ("s0", "f0")),),
        Layout.NHD,
        4,
        4,
    )
    assert instance_block_bytes(mixed, 2, 1) == 2 * full.page_size_bytes
    with pytest.raises(ConfigError, match="different KV head counts"):
        instance_block_bytes(mixed, 2, 2)


def test_offload_rule_for_a_sliding_group_s_first_block_is_the_scheduler_s():
    """first_allocated_block (the offload connector's rule) is the SlidingWindowManager's: the
    first non-null table entry of a request allocated `num_tokens` at once, for windows that
    are and are not block multiples."""
    from kvferry.kv.window import first_allocated_block
    from kvferry.scheduler.block_pool import BlockPool
    from kvferry.scheduler.single_type_manager import SlidingWindowManager

    for block_size, window in [(4, 10), (16, 10), (8, 16), (16, 512), (4, 1)]:
        spec = SlidingWindowSpec(block_size, 1, 8, torch.float32, sliding_window=window)
        for num_tokens in range(1, 90, 3):
            pool = BlockPool(64, False, reserve_null_block=True)
            manager = SlidingWindowManager(spec, pool, 0, None)
            table = manager.allocate_new_blocks("r", num_tokens)
            first = next(i for i, b in enumerate(table) if not b.is_null)
            expected = first_allocated_block(window, block_size, num_tokens)
            assert first == expected, (block_size, window, num_tokens)


def test_block_copier_on_shared_tensors_copies_each_group_s_block_and_skips():
    """One tensor serving a sliding and a full layer: a slot row has one page per group, each
    addressed by its group's id; SKIP leaves a group out (rows and device alike)."""
    from kvferry.connector.offload.blocks import SKIP

    sliding = SlidingWindowSpec(4, 2, 8, torch.float32, sliding_window=6)
    full = FullAttentionSpec(4, 2, 8, torch.float32)
    page = full.page_size_bytes
    config = KVCacheConfig(
        (KVCacheGroup(sliding, ("s",)), KVCacheGroup(full, ("f",))),
        (KVCacheTensor(page * 8, ("s", "f")),),
        Layout.HND,
        8,
        8,
    )
    caches = allocate_kv_caches(config, "cpu")
    caches["s"].copy_(torch.randn(caches["s"].shape))
    copier = BlockCopier(caches, config)
    assert copier.slot_bytes == 2 * page and copier.group_ranges == {1: (0, page), 0: (page, 2 * page)}
    assert copier.ranges([0]) == [(page, 2 * page)] and copier.ranges([0, 1]) == [(0, 2 * page)]
    before = caches["f"].clone()
    rows = copier.gather([(2, 5), (SKIP, 6)])  # (sliding id, full id): block 5 and 2 differ
    assert torch.equal(rows[0, :page].view(torch.float32), before[:, 5].reshape(-1))
    assert torch.equal(rows[0, page:].view(torch.float32), before[:, 2].reshape(-1))
    assert copier.bytes_of((2, 5)) == 2 * page and copier.bytes_of((SKIP, 6)) == page
    copier.scatter(rows, [(3, 1), (SKIP, 7)])  # row 1's sliding page was never gathered
    after = caches["f"]
    assert torch.equal(after[:, 1], before[:, 5]) and torch.equal(after[:, 7], before[:, 6])
    assert torch.equal(after[:, 3], before[:, 2])
    unwritten = [b for b in range(8) if b not in (1, 3, 7)]
    assert torch.equal(after[:, unwritten], before[:, unwritten])


def test_tiers_move_only_the_named_ranges_and_check_their_checksum(tmp_path):
    row = torch.arange(100, dtype=torch.uint8)
    ranges = [(0, 40), (70, 100)]
    tag = Tag(h(1), 3, payload_crc(row, ranges))
    dram = DramTier(num_slots=2, slot_bytes=100)
    dram.buffer.zero_()
    dram.write([1], row.view(1, 100), [tag], ranges)
    assert torch.equal(dram.buffer[1, 40:70], torch.zeros(30, dtype=torch.uint8))
    assert dram.check(1, tag, True, ranges) and not dram.check(1, tag, True)
    disk = DiskTier(str(tmp_path), num_slots=2, slot_bytes=100)
    disk.write(0, row, tag, ranges)
    out = torch.zeros(100, dtype=torch.uint8)
    assert disk.read(0, out, tag, True, ranges) and torch.equal(out[:40], row[:40])
    assert torch.equal(out[40:70], torch.zeros(30, dtype=torch.uint8)) and torch.equal(out[70:], row[70:])
    out.zero_()
    assert disk.read(0, out, tag, False, [(70, 100)]) and int(out[:70].sum()) == 0
    disk.close()


# ---- tiers --------------------------------------------------------------------------------


def test_dram_tags_reject_stale_and_unwritten_slots():
    dram = DramTier(num_slots=3, slot_bytes=8)
    rows = torch.arange(16, dtype=torch.uint8).view(2, 8)
    dram.write([2, 0], rows, [Tag(h(1), 5, payload_crc(rows[0])), Tag(h(2), 6, payload_crc(rows[1]))])
    assert torch.equal(dram.buffer[2], rows[0]) and dram.check(2, Tag(h(1), 5), verify_checksum=True)
    assert not dram.check(2, Tag(h(1), 4), False)  # another save of the same block
    assert not dram.check(0, Tag(h(1), 6), False) and not dram.check(1, Tag(h(3), 1), False)
    dram.buffer[0, 3] ^= 0xFF
    assert dram.check(0, Tag(h(2), 6), verify_checksum=False)  # payloads are not checked by default
    assert not dram.check(0, Tag(h(2), 6), verify_checksum=True)


def test_disk_slots_verify_header_and_optional_checksum(tmp_path):
    disk = DiskTier(str(tmp_path), num_slots=4, slot_bytes=100, rank=1)
    row = torch.randint(0, 256, (100,), dtype=torch.uint8)
    out = torch.empty(100, dtype=torch.uint8)
    assert not disk.read(3, out, Tag(h(1), 1), False)  # never written
    disk.write(3, row, Tag(h(1), 7, payload_crc(row)))
    assert disk.read(3, out, Tag(h(1), 7), verify_checksum=True) and torch.equal(out, row)
    assert not disk.read(3, out, Tag(h(1), 8), False) and not disk.read(3, out, Tag(h(2), 7), False)
    with open(disk.path, "r+b") as f:
        f.seek(disk.payload_offset(3) + 10)
        f.write(b"\x00\x01\x02")
    assert disk.read(3, out, Tag(h(1), 7), verify_checksum=False)  # header intact: loaded as is
    assert not disk.read(3, out, Tag(h(1), 7), verify_checksum=True)
    disk.invalidate(3)
    assert not disk.read(3, out, Tag(h(1), 7), False)
    path = disk.path
    disk.close()
    assert "rank1" in path and not (tmp_path / path).exists()


def test_disk_tier_larger_than_the_free_space_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="free"):
        DiskTier(str(tmp_path), num_slots=1 << 40, slot_bytes=1 << 20)


# ---- jobs and block copies -----------------------------------------------------------------


def test_job_queue_runs_in_order_and_survives_a_failing_job():
    queue = JobQueue("test-jobs")
    gate, seen = threading.Event(), []
    queue.submit(gate.wait)
    queue.submit(lambda: 1 / 0)
    last = queue.submit(lambda: seen.append("done"))
    assert not queue.wait(last, timeout=0.05)  # blocked behind the gate
    gate.set()
    assert queue.wait(last, timeout=5) and queue.is_done(last) and seen == ["done"]
    queue.close()
    with pytest.raises(RuntimeError):
        queue.submit(lambda: None)


@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
def test_block_copier_round_trips_blocks_of_every_tensor(layout):
    full = FullAttentionSpec(4, 2, 8, torch.float32)
    half = FullAttentionSpec(4, 1, 8, torch.bfloat16)
    groups = (KVCacheGroup(full, ("a", "b")), KVCacheGroup(half, ("c",)))
    tensors = (
        KVCacheTensor(full.page_size_bytes * 6, ("a",)),
        KVCacheTensor(full.page_size_bytes * 6, ("b",)),
        KVCacheTensor(half.page_size_bytes * 6, ("c",)),
    )
    config = KVCacheConfig(groups, tensors, layout, 6, 6)
    caches = allocate_kv_caches(config, "cpu")
    for tensor in caches.values():
        tensor.copy_(torch.randn(tensor.shape))
    copier = BlockCopier(caches, config)
    assert copier.slot_bytes == slot_bytes_per_rank(config) == 2 * full.page_size_bytes + half.page_size_bytes
    rows = copier.gather([(1, 5), (3, 0)])  # (group 0 block, group 1 block) per slot
    before = {name: t.clone() for name, t in caches.items()}
    copier.scatter(rows, [(4, 2), (2, 3)])
    assert torch.equal(caches["a"][:, 4], before["a"][:, 1]) and torch.equal(
        caches["b"][:, 2], before["b"][:, 3]
    )
    assert torch.equal(caches["c"][:, 2], before["c"][:, 5]) and torch.equal(
        caches["c"][:, 3], before["c"][:, 0]
    )
    assert torch.equal(caches["a"][:, 0], before["a"][:, 0])  # untouched blocks stay


def test_block_runs_for_copies_cut_at_gaps_and_at_the_length_cap() -> None:
    from kvferry.connector.offload.blocks import _runs

    def rows(ids: list[int]) -> list[tuple[int, int]]:
        return list(enumerate(ids))

    assert _runs(rows([4, 5, 6, 9, 3])) == [(0, 4, 3), (3, 9, 1), (4, 3, 1)]
    assert _runs(rows([4, 5, 6]), max_run=1) == [(0, 4, 1), (1, 5, 1), (2, 6, 1)]
    assert _runs(rows([4, 5, 6]), max_run=2) == [(0, 4, 2), (2, 6, 1)]
    assert _runs([(0, 4), (2, 5), (3, 6)]) == [(0, 4, 1), (2, 5, 2)]  # a skipped row cuts a run
