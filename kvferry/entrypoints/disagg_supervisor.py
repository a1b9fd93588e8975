"""What `kvferry disagg` does when one of its processes dies: restart it, or give it up.

A process that exits while the deployment runs is restarted with the same command and
environment (so the same port, side-channel port, secrets and settings) after a backoff
that doubles with each restart in a sliding window (``RestartPolicy``). Past
``max_restarts`` restarts in that window it stays down. The rest of the deployment keeps
serving meanwhile: the proxy's health checks take the dead instance out of its rotation
and put it back once it answers /health again (and count the restart, proxy/health.py).
The deployment ends only when a role has no process left that is running or waiting for
its restart (``RoleLost``), or when a stop is asked for.

``Fleet`` is the bookkeeping, pure (no processes, no clock of its own) so that it is
unit-tested; ``supervise`` drives it over real processes.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, TypeVar

from kvferry.errors import ConfigError

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5


@dataclass(frozen=True)
class RestartPolicy:
    """Restart after ``backoff_s``, doubled for each restart already made in the last
    ``window_s`` seconds, at most ``max_backoff_s``; give up once ``max_restarts`` were
    made in that window (0: never restart)."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError("the number of restarts must not be negative")
        if self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ConfigError("restart window must be positive, backoff non-negative and at most its cap")

    def recent(self, restarts: Sequence[float], now: float) -> int:
        """How many of the restarts (monotonic times) fall in the window ending at ``now``."""
        return sum(1 for t in restarts if now - t < self.window_s)

    def delay(self, recent: int) -> float:
        """Seconds to wait before the next restart, ``recent`` restarts being in the window."""
        return float(min(self.max_backoff_s, self.backoff_s * 2.0**recent))

    def next_delay(self, restarts: Sequence[float], now: float) -> float | None:
        """Seconds until the next restart of a process that exited at ``now``; None: give up."""
        recent = self.recent(restarts, now)
        if recent >= self.max_restarts:
            return None
        return self.delay(recent)


def add_restart_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("when a process dies")
    default = RestartPolicy()
    group.add_argument(
        "--max-restarts",
        type=int,
        default=default.max_restarts,
        help="restarts of one process within --restart-window before it stays down; 0: none "
        "(the deployment ends once a role has no instance left)",
    )
    group.add_argument("--restart-window", type=float, default=default.window_s, help="seconds")
    group.add_argument(
        "--restart-backoff",
        type=float,
        default=default.backoff_s,
        help=f"seconds before the first restart, doubled for each further one in the window "
        f"(at most {default.max_backoff_s:g})",
    )
    group.add_argument(
        "--health-interval",
        type=float,
        default=None,
        help="seconds between the proxy's health checks of the instances (default: the proxy's)",
    )


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    default = RestartPolicy()
    return RestartPolicy(
        max_restarts=args.max_restarts,
        window_s=args.restart_window,
        backoff_s=args.restart_backoff,
        max_backoff_s=max(default.max_backoff_s, args.restart_backoff),
    )


class MemberState(StrEnum):
    RUNNING = "running"
    WAITING = "waiting"  # exited; restarts at restart_at
    DOWN = "down"  # exited and given up


@dataclass
class Member:
    name: str
    role: str
    state: MemberState = MemberState.RUNNING
    restarts: list[float] = field(default_factory=list)  # when each restart in the window was made
    restart_at: float | None = None
    exit_code: int | None = None


@dataclass(frozen=True)
class RoleLost:
    """Every process of ``role`` is down for good; the deployment must end."""

    role: str
    last: Member

    def message(self, policy: RestartPolicy) -> str:
        if policy.max_restarts == 0:
            why = "restarts are off (--max-restarts 0)"
        else:
            why = f"{policy.max_restarts} restarts in {policy.window_s:g} s, the most allowed"
        return (
            f"no {self.role} instance left: {self.last.name} exited with code {self.last.exit_code} "
            f"and stays down ({why}); everything was stopped"
        )


class Fleet:
    """The supervised processes' states; every method takes the time from the caller."""

    def __init__(self, roles: dict[str, str], policy: RestartPolicy) -> None:
        self.policy = policy
        self.members = {name: Member(name, role) for name, role in roles.items()}

    def exited(self, name: str, code: int, now: float) -> Member:
        """Record that ``name`` exited: it waits for a restart, or is down for good."""
        member = self.members[name]
        member.exit_code = code
        delay = self.policy.next_delay(member.restarts, now)
        if delay is None:
            member.state, member.restart_at = MemberState.DOWN, None
        else:
            member.state, member.restart_at = MemberState.WAITING, now + delay
        return member

    def due(self, now: float) -> list[Member]:
        """The waiting members whose restart time has come."""
        return [
            m
            for m in self.members.values()
            if m.state is MemberState.WAITING and m.restart_at is not None and m.restart_at <= now
        ]

    def restarted(self, name: str, now: float) -> None:
        member = self.members[name]
        member.state, member.restart_at = MemberState.RUNNING, None
        member.restarts = [t for t in member.restarts if now - t < self.policy.window_s] + [now]

    def alive(self, role: str) -> list[Member]:
        """Members of ``role`` running or waiting for a restart."""
        return [m for m in self.members.values() if m.role == role and m.state is not MemberState.DOWN]

    def lost_role(self, last: Member) -> RoleLost | None:
        """A RoleLost if ``last`` (just given up) was its role's last member."""
        if last.state is MemberState.DOWN and not self.alive(last.role):
            return RoleLost(last.role, last)
        return None


class Supervised(Protocol):
    """A process of the deployment, as `kvferry disagg` starts it (disagg.Child)."""

    @property
    def name(self) -> str: ...

    @property
    def role(self) -> str: ...

    def exit_code(self) -> int | None:
        """None while it runs (or was never started)."""
        ...


P = TypeVar("P", bound=Supervised)


def supervise(
    children: Sequence[P],
    policy: RestartPolicy,
    stop: threading.Event,
    restart: Callable[[P], None],
    reap: Callable[[P], None],
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = POLL_INTERVAL_S,
) -> RoleLost | None:
    """Until ``stop`` is set (None) or a role is lost (RoleLost): restart what exits.

    ``reap`` clears what an exited child left behind (its process group) before anything
    else, so that its ports are free for the restart; ``restart`` starts it again (an
    OSError there leaves it exited, so it counts as one more exit)."""
    fleet = Fleet({c.name: c.role for c in children}, policy)
    by_name = {c.name: c for c in children}
    while not stop.wait(poll_s):
        now = clock()
        for child in children:
            member = fleet.members[child.name]
            code = child.exit_code()
            if member.state is not MemberState.RUNNING or code is None:
                continue
            reap(child)
            member = fleet.exited(child.name, code, now)
            _log_exit(fleet, member, now)
            lost = fleet.lost_role(member)
            if lost is not None:
                return lost
        for member in fleet.due(clock()):
            fleet.restarted(member.name, clock())
            try:
                restart(by_name[member.name])
            except OSError as exc:  # still exited: the next round counts it as another exit
                logger.error("%s could not be started again: %s", member.name, exc)
                continue
            logger.info("%s restarted (%d restarts in the window)", member.name, len(member.restarts))
    return None


def _log_exit(fleet: Fleet, member: Member, now: float) -> None:
    if member.restart_at is not None:
        logger.warning(
            "%s exited with code %s; restarting it in %.1f s",
            member.name,
            member.exit_code,
            member.restart_at - now,
        )
        return
    left = ", ".join(m.name for m in fleet.alive(member.role)) or "none"
    logger.error(
        "%s exited with code %s and stays down (%d restarts in %g s); %s instances left: %s",
        member.name,
        member.exit_code,
        fleet.policy.recent(member.restarts, now),
        fleet.policy.window_s,
        member.role,
        left,
    )
