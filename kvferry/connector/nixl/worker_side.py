"""The NixlConnector's worker half: registration, and one thread that moves the bytes.

`register` registers the KV regions with a NIXL agent (no progress thread), binds the
side channel (prefill roles), gathers every TP rank's agent and regions (so any rank can
answer a handshake for the whole engine) and starts the transfer thread. The thread owns
the agent and the sockets: it serves the side channel and the leases, runs the decode
loads, and progresses NIXL every millisecond while anything is outstanding. The step
hooks only hand it the step's metadata and take its results.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import torch
import zmq

from kvferry.config import EngineConfig, KVRole
from kvferry.connector.nixl.agent import Agent
from kvferry.connector.nixl.auth import PeerAuth
from kvferry.connector.nixl.channel import Clients, Server
from kvferry.connector.nixl.gate import GateCounts
from kvferry.connector.nixl.leases import LeaseTable
from kvferry.connector.nixl.loads import ConsumerLoads
from kvferry.connector.nixl.metadata import NixlConnectorMetadata, NixlSettings
from kvferry.connector.nixl.plan import RankView
from kvferry.connector.nixl.progress import LayerProgress
from kvferry.connector.nixl.protocol import EngineInfo, LayerRegion, RankInfo
from kvferry.connector.nixl.regions import compat_hash, describe_regions, group_infos
from kvferry.connector.nixl.serve import ProducerService
from kvferry.errors import ConfigError
from kvferry.kv.spec import KVCacheConfig
from kvferry.model.layers.parallel import kv_head_range

logger = logging.getLogger(__name__)

POLL_BUSY_MS = 1
POLL_IDLE_MS = 50


def gather_ranks(info: RankInfo, tp_size: int) -> list[RankInfo]:
    """Every TP rank's RankInfo, in rank order (a collective: all ranks register together)."""
    if tp_size == 1:
        return [info]
    import torch.distributed as dist

    out: list[RankInfo | None] = [None] * tp_size
    dist.all_gather_object(out, info)
    ranks = [r for r in out if r is not None]
    assert len(ranks) == tp_size, "all_gather_object fills every slot"
    return sorted(ranks, key=lambda r: r.rank)


def head_range(config: KVCacheConfig, rank: int, tp: int, total_heads: int) -> tuple[int, int]:
    """This rank's global KV heads; KVCacheConfig's per-rank count must agree with the TP rule."""
    start, count = kv_head_range(rank, tp, total_heads)
    for g in config.groups:
        if g.spec.num_kv_heads != count:
            raise ConfigError(
                f"NixlConnector: rank {rank}/{tp} holds {g.spec.num_kv_heads} KV heads in its KV cache "
                f"config, tensor parallelism places {count} of {total_heads} there"
            )
    return start, count


def local_views(
    config: KVCacheConfig, layers: list[LayerRegion], head_start: int, device_id: int
) -> list[RankView]:
    by_name = {layer.name: layer for layer in layers}
    return [
        RankView(
            layout=config.layout,
            heads=g.spec.num_kv_heads,
            head_start=head_start,
            block_size=g.spec.block_size,
            head_size=g.spec.head_size,
            itemsize=g.spec.dtype.itemsize,
            layers={name: by_name[name] for name in g.layer_names},
            device_id=device_id,
        )
        for g in config.groups
    ]


def wants_progress_thread(setting: bool, role: KVRole) -> bool:
    """NIXL's progress thread on a worker that only serves READs (unless set off): it wakes
    on UCX's events while the forward computes. Never where the worker reads KV itself
    (consumer, both): a READ it cancels must not land later in blocks already freed, so its
    own transfer thread's progress calls stay the only place data lands (loads.py), and
    that thread polls its READs every millisecond anyway."""
    return setting and role is KVRole.PRODUCER


class TransferThread(threading.Thread):
    """Owns the agent and sockets after registration; talks to the step hooks by queues."""

    def __init__(
        self,
        agent: Agent,
        ctx: zmq.Context[zmq.Socket[bytes]],
        poller: zmq.Poller,
        clients: Clients,
        producer: ProducerService | None,
        consumer: ConsumerLoads | None,
    ):
        super().__init__(name=f"nixl-{agent.name}", daemon=True)
        self.agent, self.ctx, self.poller, self.clients = agent, ctx, poller, clients
        self.producer, self.consumer = producer, consumer
        self._lock = threading.Lock()
        self._inbox: list[NixlConnectorMetadata] = []
        self._sending: set[str] = set()
        self._stats: dict[str, float] = {}
        self._halt = threading.Event()
        addr = f"inproc://nixl-wake-{uuid.uuid4().hex}"
        self._wake_in = ctx.socket(zmq.PULL)
        self._wake_in.bind(addr)
        poller.register(self._wake_in, zmq.POLLIN)
        self._wake_out = ctx.socket(zmq.PUSH)  # used by the step hooks' thread only
        self._wake_out.connect(addr)
        self._expired_seen = 0
        self._gate_seen = GateCounts()

    def submit(self, meta: NixlConnectorMetadata) -> None:
        if not meta.for_transfer_thread:
            return
        with self._lock:
            self._inbox.append(meta)
        self.wake()

    def take(self) -> tuple[set[str], set[str], set[str], dict[str, float], dict[str, int]]:
        """(finished sending, finished receiving, failed receiving, stats, first tokens of
        streamed prefills received) since the last call."""
        with self._lock:
            sending, self._sending = self._sending, set()
            stats, self._stats = self._stats, {}
            recving, failed, load_stats, tokens = (
                self.consumer.take() if self.consumer else (set(), set(), {}, {})
            )
        for key, value in load_stats.items():
            stats[key] = stats.get(key, 0.0) + value
        return sending, recving, failed, stats, tokens

    def wake(self) -> None:
        """Wake the thread now (the step hooks' thread only: it owns the wake socket)."""
        try:
            self._wake_out.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # wake-ups are queued already

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread; False if it did not end in time (its sockets stay open)."""
        self._halt.set()
        self.wake()
        self.join(timeout_s)
        self._wake_out.close(linger=0)
        return not self.is_alive()

    def run(self) -> None:
        while not self._halt.is_set():
            self.poller.poll(POLL_BUSY_MS if self._must_poll() else POLL_IDLE_MS)
            try:
                self._once()
            except Exception:
                logger.exception("NIXL transfer thread: iteration failed")
        self._close()

    def _must_poll(self) -> bool:
        """Whether this thread must look every millisecond: READs of its own in flight (their
        completion has no event to wake it), or leases held by an agent that only this
        thread progresses. Everything else wakes it: side-channel messages, the step hooks."""
        if self.consumer is not None and self.consumer.busy:
            return True
        return self.producer is not None and self.producer.busy and not self.agent.progress_thread

    def _once(self) -> None:
        while True:
            try:
                self._wake_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for meta in inbox:
            self._apply(meta)
        self.clients.receive()
        with self._lock:  # results and load state change together with take()
            if self.producer is not None:
                self.producer.serve()
                self.producer.tick()
                self._collect_producer(self.producer)
            if self.consumer is not None:
                self.consumer.tick()
        # Always (where no progress thread does it): a decoder may read blocks whose lease just
        # ended (its Done will be refused), and a passive side that never progresses leaves
        # that READ hanging.
        self.agent.progress()

    def _apply(self, meta: NixlConnectorMetadata) -> None:
        if self.producer is not None:
            self.producer.hold(meta.holds)  # before the releases: a hold may end in the same step
            self.producer.finish(meta.finishes, meta.forgotten)
            self.producer.release(meta.releases)
        if self.consumer is not None:
            for spec in meta.loads:
                self.consumer.add(spec)
            for request_id in meta.cancels:
                self.consumer.cancel(request_id)

    def _collect_producer(self, producer: ProducerService) -> None:
        table = producer.table
        self._sending |= producer.take_finished()
        if table.num_expired != self._expired_seen:
            self._stats["nixl_expired_leases"] = (
                self._stats.get("nixl_expired_leases", 0.0) + table.num_expired - self._expired_seen
            )
            self._expired_seen = table.num_expired
        self._count_gate(producer.server.gate.counts)

    def _count_gate(self, counts: GateCounts) -> None:
        """Refused side-channel requests and failed proofs since the last step, as stats."""
        seen = self._gate_seen
        for key, now, before in (
            ("nixl_side_channel_refused", counts.refused, seen.refused),
            ("nixl_side_channel_auth_failed", counts.failed, seen.failed),
        ):
            if now != before:
                self._stats[key] = self._stats.get(key, 0.0) + now - before
        self._gate_seen = GateCounts(counts.refused, counts.failed)

    def _close(self) -> None:
        self.clients.close()
        if self.producer is not None:
            self.producer.server.close()
        self.poller.unregister(self._wake_in)
        self._wake_in.close(linger=0)
        self.agent.close()


class NixlWorker:
    def __init__(self, engine_config: EngineConfig, settings: NixlSettings, tp_rank: int, auth: PeerAuth):
        self.config = engine_config
        self.auth = auth
        self.settings = settings
        self.rank = tp_rank
        self.tp_size = engine_config.parallel.tensor_parallel_size
        self.role = engine_config.kv_transfer.kv_role
        self.thread: TransferThread | None = None
        self.ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self.progress = LayerProgress()  # layer-wise: written by the forward's hooks

    def register(self, kv_caches: dict[str, torch.Tensor], config: KVCacheConfig) -> None:
        heads = head_range(config, self.rank, self.tp_size, self.config.model.num_kv_heads)
        regions, layers = describe_regions(kv_caches, config)
        device_id = regions[0].device_id if regions else 0
        agent = Agent(
            f"{self.settings.engine_id}-tp{self.rank}-{uuid.uuid4().hex[:8]}",
            self.config.device,
            wants_progress_thread(self.settings.progress_thread, self.role),
        )
        agent.register(regions)
        self.ctx = zmq.Context()
        poller = zmq.Poller()
        server = None
        if self.role is not KVRole.CONSUMER:
            port = self.settings.side_channel_port if self.rank == 0 else 0
            server = Server(self.ctx, self.settings.side_channel_host, port, poller, self.auth)
        mine = RankInfo(
            self.rank,
            self.settings.side_channel_host,
            server.port if server else 0,
            agent.name,
            agent.metadata(),
            layers,
            *heads,
        )
        info = EngineInfo(
            engine_id=self.settings.engine_id,
            compat_hash=compat_hash(self.config.model, config),
            tp_size=self.tp_size,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            layout=config.layout.value,
            total_kv_heads=self.config.model.num_kv_heads,
            lease_s=self.settings.lease_s,
            groups=group_infos(config),
            ranks=gather_ranks(mine, self.tp_size),
        )
        clients = Clients(self.ctx, poller, self.auth, self.settings.handshake_timeout_s)
        producer = consumer = None
        if server is not None:
            table = LeaseTable(self.rank, self.tp_size, self.config.model.num_kv_heads)
            producer = ProducerService(server, info, table, self.settings.unknown_grace_s, self.progress)
        if self.role is not KVRole.PRODUCER:
            views = local_views(config, layers, heads[0], device_id)
            consumer = ConsumerLoads(agent, clients, views, self.settings, self.rank, self.tp_size)
        self.thread = TransferThread(agent, self.ctx, poller, clients, producer, consumer)
        self.thread.start()
        logger.info(
            "NIXL worker rank %d of engine %s: %d regions, side channel %s",
            self.rank,
            self.settings.engine_id,
            len(regions),
            f"{mine.host}:{mine.port}" if server else "none",
        )

    def start_load(self, meta: NixlConnectorMetadata) -> None:
        if self.thread is not None:
            self.thread.submit(meta)

    def layer_saved(self, layer_name: str, meta: NixlConnectorMetadata) -> None:
        """The forward wrote this layer's KV: for the step's streamed prefills it is final."""
        if meta.streams:
            self.progress.saved(meta.streams, layer_name)
            if self.thread is not None:
                self.thread.wake()  # a decoder's Progress waits for this layer
            if self.settings.fault_layer_delay_s:
                time.sleep(self.settings.fault_layer_delay_s)  # a slow forward: reads overlap it

    def take(self) -> tuple[set[str], set[str], set[str], dict[str, float], dict[str, int]]:
        if self.thread is None:
            return set(), set(), set(), {}, {}
        return self.thread.take()

    def shutdown(self) -> None:
        stopped = True
        if self.thread is not None:
            stopped = self.thread.stop()
            self.thread = None
        if self.ctx is not None:
            if stopped:
                self.ctx.term()
            else:
                logger.warning("NIXL transfer thread did not stop; leaving its sockets to the process exit")
            self.ctx = None
