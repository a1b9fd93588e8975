"""`kvferry disagg`'s supervisor without processes: the restart policy (backoff schedule,
give-up rule, sliding window), the fleet's bookkeeping, the supervise loop over stand-in
children; and the proxy's side of it: restarts seen through /health, instances up/down."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
from prometheus_client import generate_latest

from kvferry.entrypoints.disagg_supervisor import (
    Fleet,
    MemberState,
    RestartPolicy,
    RoleLost,
    supervise,
)
from kvferry.entrypoints.proxy.metrics import ProxyMetrics
from kvferry.entrypoints.proxy.pool import InstancePool, RoundRobin
from kvferry.errors import ConfigError

POLICY = RestartPolicy(max_restarts=3, window_s=100.0, backoff_s=1.0, max_backoff_s=3.0)


def test_backoff_doubles_per_recent_restart_up_to_its_cap() -> None:
    policy = RestartPolicy(max_restarts=10, window_s=100.0, backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.delay(n) for n in range(6)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_gives_up_after_max_restarts_in_the_window_and_the_window_slides() -> None:
    assert POLICY.next_delay([], now=0.0) == 1.0
    assert POLICY.next_delay([10.0, 20.0], now=30.0) == 3.0  # 4 s capped at 3
    assert POLICY.next_delay([10.0, 20.0, 30.0], now=40.0) is None  # 3 restarts within 100 s
    # the first restart left the window: one more is allowed, its backoff counts the two left
    assert POLICY.next_delay([10.0, 20.0, 30.0], now=115.0) == 3.0
    assert POLICY.next_delay([10.0, 20.0, 30.0], now=200.0) == 1.0  # all old: as at first


def test_no_restarts_gives_up_at_the_first_exit() -> None:
    assert RestartPolicy(max_restarts=0).next_delay([], now=0.0) is None


@pytest.mark.parametrize(
    "kwargs",
    [{"max_restarts": -1}, {"window_s": 0.0}, {"backoff_s": -1.0}, {"backoff_s": 5.0, "max_backoff_s": 1.0}],
)
def test_bad_policy_is_a_config_error(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        RestartPolicy(**kwargs)


def test_fleet_restarts_then_gives_up_and_loses_a_role_only_with_its_last_member() -> None:
    fleet = Fleet({"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}, POLICY)
    member = fleet.exited("decode-1", -9, now=0.0)
    assert member.state is MemberState.WAITING and member.restart_at == 1.0
    assert fleet.due(0.5) == [] and fleet.due(1.0) == [member]
    fleet.restarted("decode-1", now=1.0)
    assert member.state is MemberState.RUNNING and fleet.due(5.0) == []
    for now in (2.0, 5.0):
        fleet.exited("decode-1", 1, now)
        fleet.restarted("decode-1", now + 1)
    member = fleet.exited("decode-1", 1, now=10.0)
    assert member.state is MemberState.DOWN and fleet.due(1000.0) == []
    assert fleet.lost_role(member) is None  # decode-0 still serves
    assert [m.name for m in fleet.alive("decode")] == ["decode-0"]
    last = Fleet({"prefill-0": "prefill"}, RestartPolicy(max_restarts=0)).exited("prefill-0", -9, 0.0)
    assert last.state is MemberState.DOWN
    gone = Fleet({"prefill-0": "prefill"}, RestartPolicy(max_restarts=0))
    lost = gone.lost_role(gone.exited("prefill-0", -9, 0.0))
    assert lost is not None and lost.role == "prefill"
    assert "no prefill instance left: prefill-0 exited with code -9" in lost.message(gone.policy)
    assert "--max-restarts 0" in lost.message(gone.policy)


@dataclass
class FakeChild:
    name: str
    role: str
    code: int | None = None
    events: list[str] = field(default_factory=list)

    def exit_code(self) -> int | None:
        return self.code


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.25  # each look at the clock moves time on
        return self.now


def _run(
    children: list[FakeChild], policy: RestartPolicy, stop_after: int, on_reap: dict[str, FakeChild]
) -> RoleLost | None:
    """supervise() over stand-ins; stops itself after ``stop_after`` restarts in all.
    Reaping a child named in ``on_reap`` makes that other child exit with -9."""
    stop = threading.Event()
    restarts: list[str] = []

    def restart(child: FakeChild) -> None:
        child.events.append("restart")
        child.code = None
        restarts.append(child.name)
        if len(restarts) >= stop_after:
            stop.set()

    def reap(child: FakeChild) -> None:
        child.events.append("reap")
        if child.name in on_reap:
            on_reap[child.name].code = -9

    return supervise(children, policy, stop, restart, reap, clock=FakeClock(), poll_s=0.0)


def _deployment() -> tuple[FakeChild, FakeChild, FakeChild]:
    return FakeChild("prefill-0", "prefill"), FakeChild("decode-0", "decode"), FakeChild("decode-1", "decode")


def test_supervise_reaps_before_restarting_and_keeps_the_others() -> None:
    prefill, d0, d1 = _deployment()
    d1.code = -9
    assert _run([prefill, d0, d1], POLICY, stop_after=1, on_reap={}) is None  # stopped, not lost
    assert d1.events == ["reap", "restart"] and d1.code is None
    assert prefill.events == d0.events == []


def test_supervise_ends_when_the_last_instance_of_a_role_is_down_for_good() -> None:
    prefill, d0, d1 = _deployment()
    d1.code = -9  # given up (no restarts) while decode-0 serves: the deployment goes on
    lost = _run([prefill, d0, d1], RestartPolicy(max_restarts=0), stop_after=1, on_reap={"decode-1": prefill})
    assert lost is not None and lost.role == "prefill" and lost.last.name == "prefill-0"
    assert d1.events == ["reap"] and prefill.events == ["reap"] and d0.events == []


def test_proxy_counts_a_restart_when_health_names_another_run() -> None:
    pool = InstancePool("decode", ["http://a", "http://b"], RoundRobin())
    a, b = pool.instances
    pool.mark(a, True)
    pool.seen_run(a, "run-1")
    pool.seen_run(a, "run-1")
    pool.mark(b, False, "health check failed: ConnectError")
    assert a.restarts == 0
    pool.seen_run(a, "run-2")
    pool.seen_run(a, None)  # a server that names no run: nothing known
    assert a.restarts == 1 and a.describe()["restarts"] == 1
    text = generate_latest(ProxyMetrics([pool]).registry).decode()
    assert 'kvferry_proxy:instance_restarts_total{instance="http://a",role="decode"} 1.0' in text
    assert 'kvferry_proxy:instances{role="decode",state="up"} 1.0' in text
    assert 'kvferry_proxy:instances{role="decode",state="down"} 1.0' in text


def test_a_restart_that_cannot_start_counts_as_one_more_exit() -> None:
    prefill = FakeChild("prefill-0", "prefill", code=127)
    attempts: list[str] = []

    def restart(child: FakeChild) -> None:
        attempts.append(child.name)
        raise FileNotFoundError("no such interpreter")

    lost = supervise([prefill], POLICY, threading.Event(), restart, lambda c: None, FakeClock(), poll_s=0.0)
    assert lost is not None and lost.role == "prefill" and lost.last.exit_code == 127
    assert attempts == ["prefill-0"] * POLICY.max_restarts
