"""Elastic KV memory on CPU: what the kernel commits, read from /proc/self/smaps and mincore."""

from __future__ import annotations

import mmap

import pytest
import torch

from kvferry.errors import ConfigError
from kvferry.kv.elastic import ElasticKVMemory, page_granularity
from kvferry.kv.memory import allocate_kv_memory
from kvferry.kv.pages import PageChanges, blocks_per_page
from kvferry.kv.spec import (
    FullAttentionSpec,
    KVAllocator,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    Layout,
)

HEADS, HEAD_SIZE, BLOCK = 2, 32, 16


def elastic_config(num_blocks: int = 64, layout: Layout = Layout.NHD, num_groups: int = 2) -> KVCacheConfig:
    spec = FullAttentionSpec(BLOCK, HEADS, HEAD_SIZE, torch.float32)
    groups = tuple(KVCacheGroup(spec, (f"g{g}.l0", f"g{g}.l1")) for g in range(num_groups))
    per_page = blocks_per_page(groups, page_granularity())
    capacity = -(-num_blocks // per_page) * per_page
    tensors = tuple(
        KVCacheTensor(spec.page_size_bytes * capacity, tuple(g.layer_names[i] for g in groups))
        for i in range(2)
    )
    return KVCacheConfig(groups, tensors, layout, num_blocks, capacity, KVAllocator.ELASTIC, per_page)


def smaps_rss(memory: ElasticKVMemory) -> int:
    """Rss of the KV mappings, as /proc/self/smaps reports it."""
    starts = {r.tensor.data_ptr() for r in memory.regions}
    total, current = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                current = int(head.split("-")[0], 16) in starts
            elif current and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def assert_accounted(memory: ElasticKVMemory) -> None:
    """The allocator's accounting, mincore and smaps agree."""
    assert memory.resident_bytes() == memory.mapped_bytes == smaps_rss(memory)


def test_reserving_and_wrapping_commits_nothing():
    memory = ElasticKVMemory(elastic_config(num_blocks=4096))
    reserved = sum(len(r.buffer) for r in memory.regions)
    assert reserved >= 4096 * 2 * elastic_config().groups[0].spec.page_size_bytes
    assert smaps_rss(memory) == 0 and memory.resident_bytes() == 0
    tensor = memory.kv_caches["g0.l0"]
    assert tensor.shape == (2, 4096, BLOCK, HEADS, HEAD_SIZE)
    assert memory.kv_caches["g1.l0"].data_ptr() == tensor.data_ptr()  # hybrid: shared
    assert smaps_rss(memory) == 0


@pytest.mark.parametrize("layout", [Layout.NHD, Layout.HND])
def test_pages_are_committed_and_returned(layout: Layout):
    config = elastic_config(layout=layout)
    memory = ElasticKVMemory(config)
    memory.apply(PageChanges(mapped=(0,), full_sync=True))
    memory.apply(PageChanges(mapped=(3, 4)))
    assert memory.mapped == {0, 3, 4}
    per_page = config.blocks_per_page
    assert memory.page_bytes == 2 * 2 * config.groups[0].spec.page_size_bytes // 2 * per_page
    assert memory.mapped_bytes == 3 * memory.page_bytes
    assert_accounted(memory)
    tensor = memory.kv_caches["g0.l1"]
    block = 3 * per_page
    tensor[:, block].fill_(1.5)  # K and V of the first block of page 3
    tensor[:, 0].fill_(2.5)
    assert_accounted(memory)  # writing a mapped block commits nothing more
    memory.apply(PageChanges(unmapped=(3,)))
    assert_accounted(memory)
    assert memory.mapped == {0, 4}
    assert torch.count_nonzero(tensor[:, block]) == 0  # a returned page reads as zeros
    assert torch.all(tensor[:, 0] == 2.5)  # other pages keep their bytes
    memory.apply(PageChanges(mapped=(0,)))  # already mapped: untouched
    assert torch.all(tensor[:, 0] == 2.5)
    memory.release()
    assert smaps_rss(memory) == 0 and memory.mapped_bytes == 0


def test_a_full_sync_returns_what_dummy_steps_wrote():
    memory = ElasticKVMemory(elastic_config())
    memory.kv_caches["g0.l0"][:, 5:30].fill_(1.0)  # a write nobody planned commits pages
    assert smaps_rss(memory) > 0
    memory.apply(PageChanges(mapped=(1,), full_sync=True))
    assert memory.mapped == {1}
    assert_accounted(memory)


def test_a_dummy_steps_pages_are_mapped_for_it_and_returned_after():
    memory = ElasticKVMemory(elastic_config())
    memory.apply(PageChanges(mapped=(0,), full_sync=True))
    per_page = memory.blocks_per_page
    memory.map_blocks([1, 3 * per_page, 3 * per_page + 1])  # page 0 is the pool's already
    assert memory.mapped == {0, 3}
    assert_accounted(memory)
    memory.return_unplanned()
    assert memory.mapped == {0}
    assert_accounted(memory)


def test_pages_hold_whole_os_pages_for_any_head_count():
    config = elastic_config()
    for heads in (1, 2, 3, 5):  # what tensor-parallel ranks may hold
        half = BLOCK * heads * HEAD_SIZE * 4
        assert half * config.blocks_per_page % mmap.PAGESIZE == 0


def test_elastic_memory_is_refused_off_cpu_and_cuda():
    with pytest.raises(ConfigError, match="works on CPU and CUDA memory"):
        allocate_kv_memory(elastic_config(), "meta")


def test_pages_are_committed_by_a_write_where_the_kernel_cannot_populate():
    memory = ElasticKVMemory(elastic_config())
    memory._populate = False  # as after MADV_POPULATE_WRITE failed with EINVAL
    memory.apply(PageChanges(mapped=(2,), full_sync=True))
    assert_accounted(memory)
    tensor = memory.kv_caches["g0.l0"]
    tensor[:, 2 * memory.blocks_per_page].fill_(3.0)
    memory.apply(PageChanges(mapped=(5,)))  # committing another page keeps page 2's bytes
    assert torch.all(tensor[:, 2 * memory.blocks_per_page] == 3.0)
    assert_accounted(memory)
