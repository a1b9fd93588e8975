"""A decoder's streamed (layer-wise) load without NIXL or sockets: layers named out of
order, or one never named before the prefill's end, are each read exactly once, and the
load is over (Done sent) only once the prefill is final and every READ has ended.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvferry.connector.nixl.agent import Transfer, TransferState
from kvferry.connector.nixl.loads import ConsumerLoads, RemoteEngine, remote_views
from kvferry.connector.nixl.metadata import LoadSpec, NixlSettings
from kvferry.connector.nixl.plan import ReadPlan
from kvferry.connector.nixl.protocol import (
    HELD,
    Ack,
    Done,
    EngineInfo,
    GroupInfo,
    GroupKind,
    LayerRegion,
    Progress,
    ProgressReply,
    RankInfo,
)
from tests.test_nixl_loads import ADDRESS, RecordingClients

LAYERS = ["l0", "l1", "l2"]
BLOCKS = 8


def _region(name: str, base: int) -> LayerRegion:
    return LayerRegion(name, base + LAYERS.index(name) * (1 << 20), BLOCKS)


@dataclass
class LayerAgent:
    """READs end at once; each remembers the remote regions it read from."""

    reads: list[set[int]] = field(default_factory=list)

    def read(self, plan: ReadPlan, remote_agent: str) -> Transfer:
        self.reads.append({int(addr) >> 20 for addr in plan.remote[:, 0]})
        return Transfer(object(), plan.num_bytes, plan.num_descriptors, TransferState.DONE)

    def poll(self, transfer: Transfer) -> TransferState:
        return transfer.state

    def release(self, transfer: Transfer) -> bool:
        return True


def _loads(agent: LayerAgent, clients: RecordingClients) -> ConsumerLoads:
    group = GroupInfo(GroupKind.FULL, 16, 2, 16, "float32", 0, LAYERS)
    rank = RankInfo(0, *ADDRESS, "prefill-agent", b"meta", [_region(n, 64 << 20) for n in LAYERS], 0, 2)
    info = EngineInfo("e1", "c", 1, 16, BLOCKS, "NHD", 2, 30.0, [group], [rank])
    settings = NixlSettings.from_extra({"engine_id": "d1"})
    local_layers = {n: _region(n, 128 << 20) for n in LAYERS}
    local = [dataclasses.replace(view, layers=local_layers) for view in remote_views(info)[0]]
    loads = ConsumerLoads(agent, clients, local, settings, rank=0, tp=1)  # type: ignore[arg-type]
    loads.engines[ADDRESS] = RemoteEngine(info, remote_views(info), {0: "prefill-agent"})
    return loads


def _progress(loads: ConsumerLoads, clients: PendingClients, layers: list[str], final: bool) -> None:
    """One round: the load asks for its Progress, gets this answer, acts on it."""
    loads.tick()
    _, message, _ = clients.sent[-1]
    assert isinstance(message, Progress)
    clients.pending[-1].reply = ProgressReply(message.seq, HELD, layers=layers, final=final)
    loads.tick()


def _layer_of(region_mb: int) -> str:
    return LAYERS[region_mb - 64]


def test_layers_out_of_order_and_a_missing_one_are_each_read_once() -> None:
    agent, clients = LayerAgent(), PendingClients()
    loads = _loads(agent, clients)
    loads.add(LoadSpec("local-1", "e1", *ADDRESS, "t1", (((0, 1), (3, 4)),), streamed=True))
    _progress(loads, clients, ["l2"], final=False)  # a later layer first
    _progress(loads, clients, ["l2", "l0"], final=False)  # l1 is not named before the end
    assert not [m for _, m, _ in clients.sent if isinstance(m, Done)]  # not final: no Done yet
    _progress(loads, clients, ["l0", "l1", "l2"], final=True)  # the end names every layer
    read = [sorted(_layer_of(mb) for mb in regions) for regions in agent.reads]
    assert read == [["l2"], ["l0"], ["l1"]]  # each once, as named
    (done,) = [m for _, m, _ in clients.sent if isinstance(m, Done)]
    assert done.ok and done.request_id == "t1"
    clients.pending[-1].reply = Ack(done.seq, True, "", first_token=42)
    loads.tick()
    finished, failed, _, tokens = loads.take()
    assert finished == {"local-1"} and not failed and tokens == {"local-1": 42}


@dataclass
class PendingClients(RecordingClients):
    """RecordingClients that keep each Pending, so a test can answer it."""

    pending: list = field(default_factory=list)

    def send(self, address, message, timeout_s):  # type: ignore[no-untyped-def]
        pending = super().send(address, message, timeout_s)
        if pending is not None:
            self.pending.append(pending)
        return pending
