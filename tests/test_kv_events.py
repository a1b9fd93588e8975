"""KV events: the block pool records them, the publisher sends them in vLLM's wire format,
a real ZMQ subscriber decodes a real engine's events and replays the ones it missed."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from kvferry.config import KVEventsConfig
from kvferry.engine.async_engine import _stats_from_wire
from kvferry.engine.core import EngineStats
from kvferry.engine.core_protocol import stats_to_wire
from kvferry.engine.kv_event_publisher import END_OF_REPLAY, KVEventPublisher, should_bind
from kvferry.entrypoints.openai.metrics import EngineStatsCollector
from kvferry.errors import ConfigError
from kvferry.sampling_params import SamplingParams
from kvferry.scheduler.block_pool import BlockPool
from kvferry.scheduler.hashing import ROOT_HASH, BlockContent, hash_block_tokens
from kvferry.scheduler.kv_events import (
    KV_EVENT_ENCODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecorder,
)
from tests.engine_helpers import assert_pool_full, make_llm

# ---- vLLM's published schema (vllm/distributed/kv_events.py), written out independently ----


class VllmEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


VLLM_DECODER = msgspec.msgpack.Decoder(VllmBatch)


def chain(tokens: list[int], block_size: int) -> list[bytes]:
    """The hashes of the full blocks of `tokens`, as the engine chains them."""
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[start : start + block_size]))
    return hashes


# ---- the block pool records, the wire carries vLLM's layout ---------------------------------


def test_block_pool_records_stores_removals_and_clears():
    recorder = KVEventRecorder(block_size=2, medium="CPU")
    pool = BlockPool(4, enable_caching=True, events=recorder)
    blocks = pool.get_new_blocks(2)
    h0 = hash_block_tokens(None, (1, 2))
    h1 = hash_block_tokens(h0, (3, 4))
    pool.cache_full_blocks(blocks, [h0, h1], [BlockContent(ROOT_HASH, (1, 2)), BlockContent(h0, (3, 4))])
    pool.cache_full_blocks(blocks[:1], [h0], [BlockContent(ROOT_HASH, (1, 2))])  # already cached: no event
    pool.free_blocks(reversed(blocks))
    stored = recorder.take()
    assert stored == [BlockStored([h0, h1], None, [1, 2, 3, 4], 2, None, "CPU")]
    taken = pool.get_new_blocks(4)  # the two spare blocks, then the cached ones, tail first
    assert recorder.take() == [BlockRemoved([h1, h0], "CPU")]
    pool.free_blocks(taken)
    again = pool.get_new_blocks(1)
    pool.cache_full_blocks(again, [h0], [BlockContent(ROOT_HASH, (1, 2))])
    pool.free_blocks(again)
    recorder.take()
    assert pool.reset_prefix_cache()
    assert recorder.take() == [AllBlocksCleared()]
    assert pool.reset_prefix_cache() and recorder.take() == []  # nothing cached: nothing said


def test_wire_format_decodes_with_vllms_schema():
    h0, h1 = b"\x01" * 32, b"\x02" * 32
    batch = KVEventBatch(
        ts=12.5,
        events=[
            BlockStored([h0, h1], None, [5, 6, 7, 8], 2, None, "CPU"),
            BlockStored([h1], h0, [7, 8], 2, None, "CPU"),
            BlockRemoved([h0], "CPU"),
            AllBlocksCleared(),
        ],
    )
    raw = KV_EVENT_ENCODER.encode(batch)
    assert msgspec.msgpack.decode(raw)[1][0][0] == "BlockStored"  # tag first, fields as an array
    assert msgspec.msgpack.decode(raw)[0] == 12.5  # the batch: [ts, events, data_parallel_rank]
    theirs = VLLM_DECODER.decode(raw)
    assert theirs.ts == 12.5
    first, second, removed, cleared = theirs.events
    assert isinstance(first, VllmBlockStored) and first.block_hashes == [h0, h1]
    assert first.parent_block_hash is None and first.token_ids == [5, 6, 7, 8] and first.block_size == 2
    assert first.lora_id is None and first.medium == "CPU"
    assert isinstance(second, VllmBlockStored) and second.parent_block_hash == h0
    assert isinstance(removed, VllmBlockRemoved) and removed.block_hashes == [h0]
    assert isinstance(cleared, VllmAllBlocksCleared)


def test_config_parses_vllms_json_and_rejects_bad_fields():
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv"}'
    )
    assert config.enabled and config.replay_endpoint == "tcp://*:5558"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true}').enabled  # publisher null
    for bad, field in (('{"publisher": "kafka"}', "publisher"), ('{"hwm": 0}', "hwm"), ('{"x": 1}', "x")):
        with pytest.raises(ConfigError, match=field):
            KVEventsConfig.from_json(bad)
    assert should_bind("tcp://*:5557", None) and not should_bind("tcp://10.0.0.1:5557", None)
    assert should_bind("tcp://127.0.0.1:5557", True)


# ---- a real subscriber -------------------------------------------------------------------


class Subscriber:
    """A consumer as a router would write one: SUB for live batches, DEALER for replays."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)
        self.topic = topic.encode()
        self.batches: dict[int, VllmBatch] = {}
        self.live: set[int] = set()  # sequence numbers received on the SUB socket

    def receive(self, timeout_ms: int) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic and len(seq) == 8
            number = int.from_bytes(seq, "big")
            self.batches[number] = VLLM_DECODER.decode(payload)
            self.live.add(number)
            timeout_ms = 0

    def replay_from(self, start: int) -> list[int]:
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        numbers = []
        while True:
            empty, seq, payload = self.replay.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                assert payload == b""
                return numbers
            number = int.from_bytes(seq, "big")
            self.batches[number] = VLLM_DECODER.decode(payload)
            numbers.append(number)

    def cached(self) -> set[bytes]:
        """The instance's cached block hashes, from the batches 0, 1, ... received so far."""
        held: set[bytes] = set()
        number = 0
        while number in self.batches:
            for event in self.batches[number].events:
                if isinstance(event, VllmBlockStored):
                    held.update(bytes(h) for h in event.block_hashes if isinstance(h, bytes))
                elif isinstance(event, VllmBlockRemoved):
                    held.difference_update(bytes(h) for h in event.block_hashes if isinstance(h, bytes))
                else:
                    held.clear()
            number += 1
        return held

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)
        self.ctx.term()


def test_engine_events_reach_a_subscriber_and_replay_fills_gaps(tiny_llama: Path, tmp_path: Path):
    """A real engine with a pool of 8 blocks of 4 tokens: a first prompt's blocks are stored
    (hashes equal to the engine's), a second prompt evicts some of them (removed), and the
    subscriber's view, live batches plus replayed ones, equals the engine's prefix cache."""
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/kv-events",
        replay_endpoint=f"ipc://{tmp_path}/kv-replay",
        topic="kv",
    )
    llm = make_llm(tiny_llama, block_size=4, num_blocks=8, kv_events=config, enforce_eager=True)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    first = list(range(10, 30))  # 5 full blocks
    llm.generate(first, greedy)
    publisher = llm.engine.kv_events
    assert publisher is not None
    while publisher.num_published < 1:  # sent before anyone listens: only a replay has it
        time.sleep(0.01)
    sub = Subscriber(config.endpoint, config.replay_endpoint or "", config.topic)
    try:
        warmups = 0
        while not sub.live and warmups < 50:  # until the subscription is live (slow joiner)
            llm.generate([7, 8, 9, 10 + warmups], greedy)
            sub.receive(200)
            warmups += 1
        assert sub.live, "the subscriber never received a live batch"
        second = list(range(100, 124))  # 6 full blocks + 1 for the next token: evicts
        llm.generate(second, greedy)
        pool = llm.engine.scheduler.kv_cache_manager.pool
        expected = {block_hash for block_hash, _group in pool.cached}
        while sub.cached() != expected:  # the publisher thread may still be sending
            sub.receive(200)
            missing = [n for n in range(max(sub.batches, default=-1) + 1) if n not in sub.batches]
            if missing:
                assert sub.replay_from(missing[0]), "replay returned nothing"
            elif not sub.sub.poll(1000):
                break
        assert 0 not in sub.live and 0 in sub.batches  # batch 0 came only from the replay
        assert sub.cached() == expected
        stored = [
            e for n in sorted(sub.batches) for e in sub.batches[n].events if isinstance(e, VllmBlockStored)
        ]
        assert stored[0].block_hashes == chain(first, 4)  # the engine's hashes, in order
        assert stored[0].parent_block_hash is None and stored[0].token_ids == first
        removals = [e for b in sub.batches.values() for e in b.events if isinstance(e, VllmBlockRemoved)]
        assert {h for e in removals for h in e.block_hashes} & set(chain(first, 4))  # evicted
        assert set(chain(second, 4)) <= expected
        assert publisher.num_dropped == 0
        assert_pool_full(llm)
    finally:
        sub.close()
        llm.engine.shutdown()


def test_publisher_replays_from_a_sequence_number(tmp_path: Path):
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        buffer_steps=3,
    )
    publisher = KVEventPublisher(config)
    sub = Subscriber(config.endpoint, config.replay_endpoint or "", "")
    try:
        for i in range(5):
            assert publisher.publish([BlockRemoved([bytes([i]) * 32], "CPU")])
        while publisher.num_published < 5:
            time.sleep(0.01)
        assert sub.replay_from(1) == [2, 3, 4]  # only the last 3 stay buffered
        assert sub.replay_from(4) == [4]
        assert sub.batches[4].events[0].block_hashes == [b"\x04" * 32]  # type: ignore[union-attr]
        assert sub.replay_from(9) == []
    finally:
        sub.close()
        publisher.shutdown()


def test_a_full_queue_drops_and_the_next_batch_starts_cleared(tmp_path: Path):
    """publish never blocks: with no room the batch is dropped and counted, and the next
    batch that gets through tells subscribers to forget this instance's blocks."""
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/pub", max_queue_size=1
    )
    publisher = KVEventPublisher(config)
    publisher.shutdown()  # the thread is gone: nothing drains the queue
    removed = BlockRemoved([b"\x01" * 32], "CPU")
    assert publisher.publish([removed])
    assert not publisher.publish([removed]) and not publisher.publish([removed])
    assert publisher.num_dropped == 2
    publisher._queue.get_nowait()  # room again
    assert publisher.publish([removed])
    batch = publisher._queue.get_nowait()
    assert batch is not None and batch.events == [AllBlocksCleared(), removed]


class _StatsOnly:
    """What the /metrics collector reads of an async engine: its latest stats."""

    def __init__(self, stats: EngineStats) -> None:
        self.stats = stats
        self.is_dead = False


def test_dropped_event_batches_are_counted_in_the_servers_metrics(tiny_llama: Path, tmp_path: Path):
    """An engine whose publisher cannot keep up (its thread stopped, a queue of one batch):
    the steps' batches past the first are dropped, and /metrics counts them, through the
    stats the engine core sends the server."""
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/pub", max_queue_size=1
    )
    llm = make_llm(tiny_llama, block_size=4, num_blocks=16, kv_events=config, enforce_eager=True)
    publisher = llm.engine.kv_events
    assert publisher is not None
    try:
        publisher.shutdown()  # nothing drains the queue from now on
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        for start in (10, 40, 70):  # each prompt stores new blocks: one batch per prompt's step
            llm.generate(list(range(start, start + 12)), greedy)
        stats = _stats_from_wire(stats_to_wire(llm.engine.stats()))
        assert (stats.kv_event_batches_published, stats.kv_event_batches_dropped) == (1, 2)
        registry = CollectorRegistry()
        registry.register(EngineStatsCollector(_StatsOnly(stats), "tiny"))  # type: ignore[arg-type]
        text = generate_latest(registry).decode()
        assert 'kvferry:kv_event_batches_dropped_total{model_name="tiny"} 2.0' in text
        assert 'kvferry:kv_event_batches_published_total{model_name="tiny"} 1.0' in text
        assert_pool_full(llm)
    finally:
        llm.engine.shutdown()
