"""Decode side of a worker: read remote blocks, then get them acknowledged (invariant 6).

Per load:  info (handshake, once per remote engine) -> read (one NIXL READ per prefill
rank this rank shares KV heads with) -> ack (Done to each of those ranks; every one must
ACK that the blocks were still held) -> over: finished, or finished and failed.

A streamed load (layer-wise, `LoadSpec.streamed`) goes info -> stream -> ack: in the
stream stage each prefill rank it reads from is asked for its Progress (the question
waits there for news); every layer it names final that was not read yet is read at once,
in its own READ, while the prefiller computes the next layers (whatever order they are
named in, and once each: the final answer names every layer). Once a rank's prefill is final and its READs are
done, that rank is complete; once all are, Done goes out as for a whole load, and the
Acks carry the prefill's first token.

A load whose READ is still in flight is never reported: the scheduler may hand its blocks
to another request once it is, and a late write would corrupt them.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

import torch

from kvferry.connector.nixl.agent import Agent, NixlError, Transfer, TransferState
from kvferry.connector.nixl.channel import Address, Clients, Pending
from kvferry.connector.nixl.leases import read_sources
from kvferry.connector.nixl.metadata import LoadSpec, NixlSettings
from kvferry.connector.nixl.plan import RankView, concat, plan_read, shared_heads
from kvferry.connector.nixl.protocol import (
    HELD,
    UNKNOWN,
    Ack,
    Done,
    EngineInfo,
    Handshake,
    HandshakeReply,
    Progress,
    ProgressReply,
)
from kvferry.kv.spec import Layout

logger = logging.getLogger(__name__)


class Stage(enum.Enum):
    """Where a load is: waiting for the prefiller's handshake, reading, waiting for ACKs."""

    INFO = "info"
    READ = "read"
    STREAM = "stream"  # a streamed load: reading layers as they become final
    ACK = "ack"


PROGRESS_WAIT_S = 1.0  # a Progress may wait this long on the prefiller for news


@dataclass
class SourceStream:
    """A streamed load's view of one prefill rank it reads from."""

    layers: list[str] = field(default_factory=list)  # read (or being read), in the order named
    asking: Pending | None = None
    final: bool = False  # the prefill finished there and every layer's READ was issued


@dataclass
class RemoteEngine:
    info: EngineInfo
    views: dict[int, list[RankView]]  # prefill rank -> one view per KV cache group
    agents: dict[int, str] = field(default_factory=dict)  # prefill rank -> NIXL agent name


@dataclass
class Load:
    spec: LoadSpec
    started: float
    stage: Stage = Stage.INFO
    engine: RemoteEngine | None = None
    readers: list[int] = field(default_factory=list)  # prefill ranks this rank reads from
    transfers: list[Transfer] = field(default_factory=list)
    sources: dict[int, SourceStream] = field(default_factory=dict)  # streamed: per prefill rank
    first_token: int | None = None
    acks: list[Pending] = field(default_factory=list)
    failure: str | None = None
    cancelled: bool = False
    read_start: float = 0.0
    read_done: float = 0.0

    @property
    def remote_engine(self) -> RemoteEngine:
        """The prefiller's engine: known from the READ stage on."""
        assert self.engine is not None, f"no remote engine yet at stage {self.stage.value}"
        return self.engine


def remote_views(info: EngineInfo) -> dict[int, list[RankView]]:
    views = {}
    for rank in info.ranks:
        by_name = {layer.name: layer for layer in rank.layers}
        views[rank.rank] = [
            RankView(
                layout=Layout(info.layout),
                heads=rank.kv_heads,
                head_start=rank.kv_head_start,
                block_size=g.block_size,
                head_size=g.head_size,
                itemsize=getattr(torch, g.dtype).itemsize,
                layers={name: by_name[name] for name in g.layer_names},
            )
            for g in info.groups
        ]
    return views


def _overlap(local: RankView, remote: RankView) -> bool:
    lo, hi = shared_heads(local, remote)
    return lo < hi


class ConsumerLoads:
    def __init__(
        self,
        agent: Agent,
        clients: Clients,
        local: list[RankView],
        settings: NixlSettings,
        rank: int,
        tp: int,
    ):
        self.agent = agent
        self.clients = clients
        self.local = local  # one view per KV cache group
        self.settings = settings
        self.rank = rank
        self.tp = tp
        self.engines: dict[Address, RemoteEngine] = {}
        self.handshakes: dict[Address, Pending] = {}
        self.loads: dict[str, Load] = {}
        self.finished: set[str] = set()
        self.failed: set[str] = set()
        self.first_tokens: dict[str, int] = {}
        self.stats: dict[str, float] = {}

    @property
    def busy(self) -> bool:
        return bool(self.loads)

    def add(self, spec: LoadSpec) -> None:
        load = Load(spec, time.monotonic())
        if spec.fail is not None:
            load.failure = spec.fail
            self._finish(load)
            return
        self.loads[spec.request_id] = load

    def cancel(self, request_id: str) -> None:
        load = self.loads.get(request_id)
        if load is not None:
            load.cancelled = True

    def tick(self) -> None:
        for load in list(self.loads.values()):
            if load.stage is Stage.INFO:
                self._start(load)
            if load.stage is Stage.READ:
                self._poll_reads(load)
            if load.stage is Stage.STREAM:
                self._stream(load)
            if load.stage is Stage.ACK and all(p.done for p in load.acks):
                self._acknowledged(load)

    def _count(self, key: str, value: float = 1.0) -> None:
        self.stats[key] = self.stats.get(key, 0.0) + value

    # ---- handshake ----------------------------------------------------------------------

    def _engine(self, load: Load) -> RemoteEngine | str | None:
        """The remote engine (agents loaded), an error, or None while the handshake runs."""
        spec = load.spec
        address = (spec.host, spec.port)
        engine = self.engines.get(address)
        if engine is not None and engine.info.engine_id == spec.engine_id:
            return engine
        pending = self.handshakes.get(address)
        if pending is None:
            msg = Handshake(self.clients.next_seq())
            self.handshakes[address] = self.clients.send(address, msg, self.settings.handshake_timeout_s)
            return None
        if not pending.done:
            return None
        del self.handshakes[address]
        reply = pending.reply
        if not isinstance(reply, HandshakeReply) or reply.info is None:
            return f"handshake with {address[0]}:{address[1]} failed: {pending.error or 'bad reply'}"
        if reply.info.engine_id != pending.peer:
            return f"the engine at {address[0]}:{address[1]} authenticated as {pending.peer}, not {reply.info.engine_id}"
        if reply.info.engine_id != spec.engine_id:
            return f"the engine at {address[0]}:{address[1]} is {reply.info.engine_id}, not {spec.engine_id}"
        engine = RemoteEngine(reply.info, remote_views(reply.info))
        for rank in reply.info.ranks:
            engine.agents[rank.rank] = self.agent.add_remote(rank.agent_metadata)
        self.engines[address] = engine
        return engine

    # ---- reads --------------------------------------------------------------------------

    def _start(self, load: Load) -> None:
        if load.cancelled:
            self._finish(load)
            return
        try:
            engine = self._engine(load)
        except NixlError as exc:
            engine = str(exc)
        if engine is None:
            return
        if isinstance(engine, str):
            load.failure = engine
            self._finish(load)
            return
        load.engine = engine
        load.stage = Stage.STREAM if load.spec.streamed else Stage.READ
        load.read_start = time.monotonic()
        load.readers = [p for p, views in engine.views.items() if _overlap(self.local[0], views[0])]
        sources = read_sources(self.rank, self.tp, engine.info.tp_size, engine.info.total_kv_heads)
        # (a reader not among the sources has its heads read from another replica; it is
        # told DONE all the same)
        for p in [p for p in load.readers if p in sources]:
            if load.spec.streamed:
                load.sources[p] = SourceStream()
            elif not self._read(load, p, None):
                break

    def _read(self, load: Load, p: int, layers: list[str] | None) -> bool:
        """READ these layers (None: all) from prefill rank p; False if NIXL refused."""
        engine = load.remote_engine
        plan = concat(
            [
                plan_read(local, remote, [n for n in layers or local.layers if n in local.layers], lids, rids)
                for local, remote, (lids, rids) in zip(
                    self.local, engine.views[p], load.spec.groups, strict=True
                )
            ]
        )
        if not plan.num_descriptors:
            return True
        try:
            load.transfers.append(self.agent.read(plan, engine.agents[p]))
        except NixlError as exc:
            load.failure = str(exc)
            return False
        self._count("nixl_transfers")
        self._count("nixl_descriptors", plan.num_descriptors)
        return True

    # ---- streamed reads ---------------------------------------------------------------------

    def _stream(self, load: Load) -> None:
        """Ask each source for news, READ the layers it names final; over once all are."""
        for p, source in load.sources.items():
            if load.failure is None and not load.cancelled and not source.final:
                self._follow(load, p, source)
        states = [self.agent.poll(t) for t in load.transfers]
        if TransferState.ERR in states and load.failure is None:
            load.failure = f"NIXL READ of {load.spec.remote_request_id} failed"
        over = load.failure is not None or load.cancelled
        if (
            not over
            and time.monotonic() - load.started
            > self.settings.stream_wait_s + self.settings.transfer_timeout_s
        ):
            load.failure = f"the streamed prefill {load.spec.remote_request_id} did not complete in time"
            over = True
        if TransferState.PROC in states:
            if over:
                self._abandon_reads(load)
            return
        if over or all(s.final for s in load.sources.values()):
            self._reads_over(load, states)

    def _follow(self, load: Load, p: int, source: SourceStream) -> None:
        rank = load.remote_engine.info.ranks[p]
        if source.asking is None:
            msg = Progress(
                self.clients.next_seq(), load.spec.remote_request_id, len(source.layers), PROGRESS_WAIT_S
            )
            timeout = PROGRESS_WAIT_S + self.settings.handshake_timeout_s
            source.asking = self.clients.send((rank.host, rank.port), msg, timeout)
            return
        if not source.asking.done:
            return
        reply, source.asking = source.asking.reply, None
        if not isinstance(reply, ProgressReply):
            load.failure = "the prefill engine did not answer a Progress"
        elif reply.status is UNKNOWN:
            return  # not held there yet (this rank may be a step behind rank 0): ask again
        elif reply.status is not HELD:
            load.failure = f"the streamed prefill cannot be read: {reply.message}"
        else:
            new = [name for name in dict.fromkeys(reply.layers) if name not in source.layers]
            if new and self._read(load, p, new):
                source.layers.extend(new)
                if not reply.final:
                    self._count("nixl_layers_read_early", len(new))  # while the prefill computes
            source.final = reply.final and load.failure is None

    def _reads_over(self, load: Load, states: list[TransferState]) -> None:
        """Every READ of a load ended: Done (ok or not) to each rank it read from."""
        load.read_done = time.monotonic()
        self._account(load, states)
        if load.failure is None and not load.cancelled:
            self._send_done(load, ok=True)
            load.stage = Stage.ACK
            return
        self._send_done(load, ok=False)
        self._finish(load)

    def _poll_reads(self, load: Load) -> None:
        states = [self.agent.poll(t) for t in load.transfers]
        if TransferState.PROC in states:
            if time.monotonic() - load.started > self.settings.transfer_timeout_s:
                self._abandon_reads(load)
            return
        if not load.read_done:
            load.read_done = time.monotonic()
            self._account(load, states)
        if load.failure is None and not load.cancelled:
            if time.monotonic() - load.read_done < self.settings.fault_done_delay_s:
                return  # fault injection: a slow decoder
            self._send_done(load, ok=True)
            load.stage = Stage.ACK
            return
        self._send_done(load, ok=False)
        self._finish(load)

    def _account(self, load: Load, states: list[TransferState]) -> None:
        seconds = load.read_done - load.read_start
        for transfer in load.transfers:
            self.agent.release(transfer)
            if transfer.state is TransferState.DONE:
                self._count("nixl_bytes_read", transfer.num_bytes)
        self._count("nixl_transfer_seconds", seconds)
        if TransferState.ERR in states and load.failure is None:
            load.failure = f"NIXL READ of {load.spec.remote_request_id} failed"

    def _abandon_reads(self, load: Load) -> None:
        """A READ past its timeout: report the load only once NIXL let go of every handle."""
        load.transfers = [t for t in load.transfers if not self.agent.release(t)]
        if load.transfers:
            return  # NIXL refused to cancel: try again next time
        # Cancelled. On DRAM, data lands only inside this thread's own progress calls, so
        # none can follow; disconnecting from the peer makes sure of it (and the next load
        # from that engine handshakes again).
        address = (load.spec.host, load.spec.port)
        if self.engines.get(address) is load.engine:
            del self.engines[address]
            for name in load.remote_engine.agents.values():
                self.agent.remove_remote(name)
        load.failure = f"NIXL READ of {load.spec.remote_request_id} timed out"
        load.read_done = time.monotonic()
        self._count("nixl_transfer_seconds", load.read_done - load.read_start)
        self._send_done(load, ok=False)
        self._finish(load)

    def _send_done(self, load: Load, ok: bool) -> None:
        timeout = self.settings.ack_timeout_s if ok else None
        for p in load.readers:
            rank = load.remote_engine.info.ranks[p]
            msg = Done(
                self.clients.next_seq(),
                load.spec.remote_request_id,
                self.settings.engine_id,
                self.rank,
                self.tp,
                ok,
            )
            pending = self.clients.send((rank.host, rank.port), msg, timeout)
            if pending is not None:
                load.acks.append(pending)

    def _acknowledged(self, load: Load) -> None:
        for pending in load.acks:
            if not isinstance(pending.reply, Ack):
                load.failure = (
                    f"the prefill engine did not acknowledge the read: {pending.error or 'bad reply'}"
                )
            elif not pending.reply.ok:
                load.failure = f"the prefill engine refused the read: {pending.reply.message}"
            elif pending.reply.first_token is not None:
                load.first_token = pending.reply.first_token
        if load.spec.streamed and load.failure is None and load.first_token is not None:
            self.first_tokens[load.spec.request_id] = load.first_token
        self._finish(load)

    def _finish(self, load: Load) -> None:
        request_id = load.spec.request_id
        self.loads.pop(request_id, None)
        self.finished.add(request_id)
        if load.failure is not None:
            self.failed.add(request_id)
            if not load.cancelled:
                self._count("nixl_failed_transfers")
                logger.warning("loading remote KV of %s failed: %s", request_id, load.failure)

    def take(self) -> tuple[set[str], set[str], dict[str, float], dict[str, int]]:
        """(finished, failed, stats, streamed prefills' first tokens) since the last call."""
        finished, failed, stats, tokens = self.finished, self.failed, self.stats, self.first_tokens
        self.finished, self.failed, self.stats, self.first_tokens = set(), set(), {}, {}
        return finished, failed, stats, tokens
