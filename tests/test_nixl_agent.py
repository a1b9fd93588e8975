"""Registration from KVCacheConfig and real NIXL READs between two agents in one process.

The KV tensors come from the engine's own allocator; two layers share one tensor (KV
sharing): it is one region, registered once. A prefill-side engine (TP=2, NHD) is read
by a decode rank (TP=1, HND): both prefill ranks' head slices land in the right place,
converted. Agents without a progress thread need the passive side progressed by hand; with
NIXL's progress thread (asleep on UCX's events) they need nobody.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from kvferry.config import CacheConfig, KVRole
from kvferry.connector.nixl.agent import Agent, Transfer, TransferState
from kvferry.connector.nixl.metadata import NixlSettings
from kvferry.connector.nixl.plan import RankView, plan_read
from kvferry.connector.nixl.regions import describe_regions
from kvferry.connector.nixl.worker_side import wants_progress_thread
from kvferry.errors import ConfigError
from kvferry.kv.allocate import allocate_kv_caches, build_kv_cache_config
from kvferry.kv.spec import (
    AttentionLayerKV,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    LatentAttentionSpec,
    Layout,
    latent_head_size,
)

BS, HEADS, DIM, BLOCKS = 4, 2, 8, 6
LAYERS = ("l0", "l1", "l2")


def _config(layout: Layout, heads: int, virtual: int = BLOCKS) -> KVCacheConfig:
    spec = FullAttentionSpec(BS, heads, DIM, torch.float32)
    size = spec.page_size_bytes * virtual
    tensors = (KVCacheTensor(size, ("l0",)), KVCacheTensor(size, ("l1", "l2")))  # l1, l2 share
    return KVCacheConfig((KVCacheGroup(spec, LAYERS),), tensors, layout, BLOCKS, virtual)


def _views(config: KVCacheConfig, caches: dict, rank: int) -> tuple[RankView, list]:
    regions, layers = describe_regions(caches, config)
    spec = config.groups[0].spec
    view = RankView(
        config.layout, spec.num_kv_heads, rank * spec.num_kv_heads, BS, DIM, 4, {r.name: r for r in layers}
    )
    return view, regions


def test_shared_tensors_are_one_region_and_capacity_comes_from_the_config():
    config = _config(Layout.NHD, HEADS, virtual=BLOCKS)
    caches = allocate_kv_caches(config, "cpu")
    regions, layers = describe_regions(caches, config)
    assert len(regions) == 2 and len(layers) == 3
    assert {r.base for r in regions} == {caches["l0"].data_ptr(), caches["l1"].data_ptr()}
    assert [layer.capacity for layer in layers] == [BLOCKS] * 3
    assert sum(r.size for r in regions) == 2 * config.tensors[0].size_bytes


def _wait(reader: Agent, target: Agent, transfer) -> str:
    deadline = time.monotonic() + 20
    while reader.poll(transfer) == "PROC":
        target.progress()
        assert time.monotonic() < deadline, "READ did not finish"
    return transfer.state


def test_nixl_read_tp2_nhd_into_tp1_hnd():
    gen = torch.Generator().manual_seed(1)
    full = {name: torch.randn(2, BLOCKS, BS, HEADS, DIM, generator=gen) for name in ("l0", "l1")}
    prefill_cfg, decode_cfg = _config(Layout.NHD, HEADS // 2), _config(Layout.HND, HEADS)
    prefill_caches = [allocate_kv_caches(prefill_cfg, "cpu") for _ in range(2)]
    for rank, caches in enumerate(prefill_caches):
        for name in ("l0", "l1"):
            caches[name].copy_(full[name][..., rank : rank + 1, :])
    decode_caches = allocate_kv_caches(decode_cfg, "cpu")
    reader = Agent("test-decode")
    local, regions = _views(decode_cfg, decode_caches, 0)
    reader.register(regions)
    remote_ids, local_ids = [4, 1, 2], [0, 3, 5]
    for rank, caches in enumerate(prefill_caches):
        target = Agent(f"test-prefill-{rank}")
        remote, regions = _views(prefill_cfg, caches, rank)
        target.register(regions)
        name = reader.add_remote(target.metadata())
        plan = plan_read(local, remote, LAYERS, local_ids, remote_ids)
        assert plan.num_bytes == 2 * 2 * len(local_ids) * BS * DIM * 4  # 2 tensors, K and V, 1 head
        transfer = reader.read(plan, name)
        assert _wait(reader, target, transfer) == "DONE"
        assert reader.release(transfer)
        target.close()
    for layer, source in (("l0", "l0"), ("l1", "l1"), ("l2", "l1")):  # l2 shares l1's tensor
        got = decode_caches[layer].transpose(2, 3)  # HND -> NHD view
        for lb, rb in zip(local_ids, remote_ids, strict=True):
            assert torch.equal(got[:, lb], full[source][:, rb])
        untouched = [b for b in range(BLOCKS) if b not in local_ids]
        assert not decode_caches[layer][:, untouched].any()
    reader.close()


def test_a_hanging_read_can_be_cancelled():
    """The passive side never progresses: the READ hangs; releasing it cancels it."""
    config = _config(Layout.NHD, HEADS)
    target_caches, local_caches = allocate_kv_caches(config, "cpu"), allocate_kv_caches(config, "cpu")
    reader = Agent("test-hang-reader", progress_thread=False)
    target = Agent("test-hang-target", progress_thread=False)
    local, regions = _views(config, local_caches, 0)
    reader.register(regions)
    remote, regions = _views(config, target_caches, 0)
    target.register(regions)
    name = reader.add_remote(target.metadata())
    transfer = reader.read(plan_read(local, remote, LAYERS, [0, 1], [2, 3]), name)
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        assert reader.poll(transfer) == "PROC"
    assert reader.release(transfer)
    reader.remove_remote(name)
    assert reader.add_remote(target.metadata()) == name  # known again after a new handshake
    reader.close()
    target.close()


def test_latent_caches_register_one_region_per_tensor_and_a_block_reads_its_latent_rows():
    """MLA: the allocator's own config for three latent layers (kv_lora_rank 32 + rope 8 = one
    40-value row per token) is registered as one region per tensor, and a block READ over
    NIXL moves exactly the latent rows of its tokens, once (one head, no per-head copies)."""
    latent = 40
    layers = [AttentionLayerKV(name, 1, latent_head_size(latent), latent_size=latent) for name in LAYERS]
    cache = CacheConfig(block_size=BS, num_gpu_blocks_override=BLOCKS)
    config = build_kv_cache_config(_Float32(), cache, layers, budget_bytes=0)
    assert isinstance(config.groups[0].spec, LatentAttentionSpec)
    source_caches, reader_caches = allocate_kv_caches(config, "cpu"), allocate_kv_caches(config, "cpu")
    for cache_tensor in source_caches.values():
        cache_tensor.copy_(torch.randn(cache_tensor.shape))
    regions, layer_regions = describe_regions(source_caches, config)
    assert len(regions) == len(config.tensors) == len(LAYERS) and len(layer_regions) == len(LAYERS)
    reader, target = Agent("test-mla-decode"), Agent("test-mla-prefill")
    local, local_regions = _latent_view(config, reader_caches)
    remote, _ = _latent_view(config, source_caches)
    reader.register(local_regions)
    target.register(regions)
    plan = plan_read(local, remote, LAYERS, [2], [5])
    assert plan.num_bytes == len(LAYERS) * BS * latent_head_size(latent) * 2 * 4  # K and V planes: one row
    assert _wait(reader, target, reader.read(plan, reader.add_remote(target.metadata()))) == "DONE"
    for name in LAYERS:
        assert torch.equal(reader_caches[name][:, 2], source_caches[name][:, 5])
        assert not reader_caches[name][:, 3].any()


class _Float32:
    dtype = torch.float32


def _latent_view(config: KVCacheConfig, caches: dict) -> tuple[RankView, list]:
    regions, layers = describe_regions(caches, config)
    head_size = config.groups[0].spec.head_size
    return RankView(config.layout, 1, 0, BS, head_size, 4, {r.name: r for r in layers}), regions


def _pair(config: KVCacheConfig) -> tuple[Agent, Agent, Transfer, dict, dict]:
    """A reader and a target over one config, and a READ of blocks 2, 3 into 0, 1 started."""
    target_caches, local_caches = allocate_kv_caches(config, "cpu"), allocate_kv_caches(config, "cpu")
    target_caches["l0"].copy_(torch.randn(target_caches["l0"].shape))
    reader, target = Agent("test-pair-reader"), Agent("test-pair-target")
    local, regions = _views(config, local_caches, 0)
    reader.register(regions)
    remote, regions = _views(config, target_caches, 0)
    target.register(regions)
    transfer = reader.read(
        plan_read(local, remote, LAYERS, [0, 1], [2, 3]), reader.add_remote(target.metadata())
    )
    return reader, target, transfer, local_caches, target_caches


def test_with_its_progress_thread_the_passive_side_serves_a_read_unattended():
    """Nobody calls the target's progress(): its NIXL progress thread serves the READ (the
    same READ hangs without the thread: test_a_hanging_read_can_be_cancelled)."""
    config = _config(Layout.NHD, HEADS)
    reader, target, transfer, local_caches, target_caches = _pair(config)
    deadline = time.monotonic() + 20
    while reader.poll(transfer) is TransferState.PROC:
        assert time.monotonic() < deadline, "the READ was not served"
        time.sleep(0.001)
    assert transfer.state is TransferState.DONE and reader.release(transfer)
    assert torch.equal(local_caches["l0"][:, :2], target_caches["l0"][:, 2:4])
    reader.close()
    target.close()


def _thread_cpu_seconds(tids: set[int]) -> float:
    ticks = 0
    for tid in tids:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def test_the_progress_thread_sleeps_between_events():
    """An idle agent's progress thread spends well under a tenth of a core (NIXL's wrapper
    starts it with no delay: a busy loop, a whole core)."""
    before = {int(t) for t in os.listdir("/proc/self/task")}
    agent = Agent("test-idle")
    threads = {int(t) for t in os.listdir("/proc/self/task")} - before
    assert threads, "the agent started no progress thread"
    start = _thread_cpu_seconds(threads)
    time.sleep(1.0)
    assert _thread_cpu_seconds(threads) - start < 0.1
    agent.close()


@pytest.mark.parametrize(
    ("setting", "role", "expected"),
    [
        (True, KVRole.PRODUCER, True),  # serves READs while its forward computes: woken by UCX
        (False, KVRole.PRODUCER, False),
        (True, KVRole.CONSUMER, False),  # reads KV itself: only its transfer thread progresses it
        (True, KVRole.BOTH, False),
    ],
)
def test_the_progress_thread_serves_reads_only_where_the_worker_reads_none(setting, role, expected):
    settings = NixlSettings.from_extra({"engine_id": "e", "progress_thread": setting})
    assert wants_progress_thread(settings.progress_thread, role) is expected


def test_a_progress_thread_setting_must_be_a_boolean():
    assert NixlSettings.from_extra({"engine_id": "e"}).progress_thread is True
    with pytest.raises(ConfigError, match="progress_thread"):
        NixlSettings.from_extra({"engine_id": "e", "progress_thread": "yes"})
