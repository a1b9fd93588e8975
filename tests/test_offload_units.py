"""Offload pieces without a model: index LRU across tiers, config checks, slot tags, copies."""

import threading

import pytest
import torch

from kvferry.config import KVTransferConfig
from kvferry.connector.offload.blocks import BlockCopier
from kvferry.connector.offload.config import OffloadConfig, instance_block_bytes, slot_bytes_per_rank
from kvferry.connector.offload.index import TierIndex
from kvferry.connector.offload.jobs import JobQueue
from kvferry.connector.offload.metadata import DemoteOp, Tier
from kvferry.connector.offload.tiers import DiskTier, DramTier, Tag, payload_crc
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
    "local_heads, total_heads, tp, expected_heads", [(1, 2, 2, 2), (2, 3, 2, 3), (1, 3, 2, 3), (1, 2, 4, 4)]
)
def test_block_bytes_are_the_same_on_every_rank(local_heads, total_heads, tp, expected_heads):
    """Capacities are per instance: uneven head splits and replicated heads included."""
    spec = FullAttentionSpec(16, local_heads, 64, torch.float32)
    kv = KVCacheConfig(
        (KVCacheGroup(spec, ("a", "b")),), tuple(KVCacheTensor(1, (n,)) for n in "ab"), Layout.NHD, 4, 4
    )
    per_head = 2 * 16 * 64 * 4 * 2  # K and V, 2 layers
    assert instance_block_bytes(kv, total_heads, tp) == per_head * expected_heads


def test_engine_start_up_rejects_bad_offload_config(tiny_llama):
    bad = KVTransferConfig("OffloadConnector", kv_connector_extra_config={"dram_gib": -2})
    for tp in (1, 2):  # checked before any worker starts
        with pytest.raises(ConfigError, match="dram_gib"):
            make_llm(tiny_llama, kv_transfer=bad, tp=tp)


def test_sliding_window_groups_are_rejected():
    spec = SlidingWindowSpec(16, 2, 16, torch.float32, sliding_window=64)
    kv = KVCacheConfig((KVCacheGroup(spec, ("a",)),), (KVCacheTensor(1, ("a",)),), Layout.NHD, 4, 4)
    from kvferry.connector.offload.config import check_kv_cache_config

    with pytest.raises(ConfigError, match="sliding-window"):
        check_kv_cache_config(kv)


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

    assert _runs([4, 5, 6, 9, 3]) == [(0, 4, 3), (3, 9, 1), (4, 3, 1)]
    assert _runs([4, 5, 6], max_run=1) == [(0, 4, 1), (1, 5, 1), (2, 6, 1)]
    assert _runs([4, 5, 6], max_run=2) == [(0, 4, 2), (2, 6, 1)]
