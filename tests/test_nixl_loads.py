"""The decoder's loads without NIXL or sockets: a READ that never ends (a cut link).

A fake agent keeps every READ in flight; a fake side-channel client records what is sent.
Past transfer_timeout_s the load is given up: reported finished and failed (the scheduler
then recomputes or fails it, per policy), the prefiller told (Done, not ok), the remote
agent dropped (the next load handshakes again). While NIXL refuses to let go of a READ's
handle the load is not reported: its blocks must not be reused under a late write.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from kvferry.connector.nixl.agent import NixlError, Transfer, TransferState
from kvferry.connector.nixl.channel import Address, Pending
from kvferry.connector.nixl.loads import ConsumerLoads, RemoteEngine, remote_views
from kvferry.connector.nixl.metadata import LoadSpec, NixlSettings
from kvferry.connector.nixl.plan import ReadPlan
from kvferry.connector.nixl.protocol import (
    ClientMessage,
    Done,
    EngineInfo,
    GroupInfo,
    GroupKind,
    LayerRegion,
    RankInfo,
)

ADDRESS: Address = ("10.0.0.2", 5555)
REMOTE_LAYER = LayerRegion("l0", 1 << 20, 8)
LOCAL_LAYER = LayerRegion("l0", 2 << 20, 8)


@dataclass
class StuckAgent:
    """Every READ stays in flight; `release` refuses `refusals` times, then succeeds."""

    refusals: int = 0
    reads: int = 0
    released: int = 0
    removed: list[str] = field(default_factory=list)

    def read(self, plan: ReadPlan, remote_agent: str) -> Transfer:
        self.reads += 1
        return Transfer(object(), plan.num_bytes, plan.num_descriptors, TransferState.PROC)

    def poll(self, transfer: Transfer) -> TransferState:
        return transfer.state

    def release(self, transfer: Transfer) -> bool:
        if self.refusals:
            self.refusals -= 1
            return False
        self.released += 1
        return True

    def add_remote(self, metadata: bytes) -> str:
        return "prefill-agent"

    def remove_remote(self, name: str) -> None:
        self.removed.append(name)


@dataclass
class RecordingClients:
    sent: list[tuple[Address, ClientMessage, float | None]] = field(default_factory=list)
    seq: int = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def send(self, address: Address, message: ClientMessage, timeout_s: float | None) -> Pending | None:
        self.sent.append((address, message, timeout_s))
        return None if timeout_s is None else Pending(address, float("inf"))


def _info() -> EngineInfo:
    group = GroupInfo(GroupKind.FULL, 16, 2, 16, "float32", 0, ["l0"])
    rank = RankInfo(0, *ADDRESS, "prefill-agent", b"meta", [REMOTE_LAYER], 0, 2)
    return EngineInfo("e1", "c", 1, 16, 8, "NHD", 2, 30.0, [group], [rank])


def _loads(agent: StuckAgent, clients: RecordingClients, timeout_s: float) -> ConsumerLoads:
    """A decoder that already handshook with the prefiller at ADDRESS (same layout, heads)."""
    settings = NixlSettings.from_extra({"engine_id": "d1", "transfer_timeout_s": timeout_s})
    info = _info()
    local = [dataclasses.replace(view, layers={"l0": LOCAL_LAYER}) for view in remote_views(info)[0]]
    loads = ConsumerLoads(agent, clients, local, settings, rank=0, tp=1)  # type: ignore[arg-type]
    loads.engines[ADDRESS] = RemoteEngine(info, remote_views(info), {0: "prefill-agent"})
    return loads


def _spec() -> LoadSpec:
    return LoadSpec("local-1", "e1", *ADDRESS, "remote-1", (((0, 1), (3, 4)),))


def _tick_until(loads: ConsumerLoads, clock: list[float], until: float) -> None:
    while clock[0] < until:
        loads.tick()
        clock[0] += 0.25


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr("kvferry.connector.nixl.loads.time.monotonic", lambda: now[0])
    return now


def _dones(clients: RecordingClients) -> list[Done]:
    return [m for _, m, _ in clients.sent if isinstance(m, Done)]


def test_a_read_in_flight_past_the_timeout_is_given_up_and_reported_failed(clock: list[float]) -> None:
    agent, clients = StuckAgent(), RecordingClients()
    loads = _loads(agent, clients, timeout_s=5.0)
    loads.add(_spec())
    _tick_until(loads, clock, 1004.5)
    assert agent.reads == 1 and loads.busy and not _dones(clients)
    assert loads.take()[:2] == (set(), set())
    _tick_until(loads, clock, 1006.0)
    finished, failed, stats, _ = loads.take()
    assert finished == failed == {"local-1"} and not loads.busy
    assert stats["nixl_failed_transfers"] == 1 and "nixl_bytes_read" not in stats
    assert agent.released == 1 and agent.removed == ["prefill-agent"]
    assert ADDRESS not in loads.engines  # the next load from there handshakes again
    [done] = _dones(clients)
    assert done.request_id == "remote-1" and not done.ok


def test_a_read_nixl_will_not_release_stays_unreported_until_it_does(clock: list[float]) -> None:
    agent, clients = StuckAgent(refusals=3), RecordingClients()
    loads = _loads(agent, clients, timeout_s=5.0)
    loads.add(_spec())
    _tick_until(loads, clock, 1005.5)
    assert loads.busy and loads.take()[:2] == (set(), set()) and not _dones(clients)
    _tick_until(loads, clock, 1007.0)
    assert loads.take()[1] == {"local-1"} and agent.released == 1


def test_a_read_that_cannot_start_fails_at_once(clock: list[float]) -> None:
    class Refusing(StuckAgent):
        def read(self, plan: ReadPlan, remote_agent: str) -> Transfer:
            raise NixlError("endpoint unreachable")

    clients = RecordingClients()
    loads = _loads(Refusing(), clients, timeout_s=5.0)
    loads.add(_spec())
    _tick_until(loads, clock, 1000.5)
    assert loads.take()[1] == {"local-1"}
    [done] = _dones(clients)
    assert not done.ok
