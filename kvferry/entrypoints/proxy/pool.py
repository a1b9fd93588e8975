"""Instances of one role (prefill or decode), their health, and how one is picked.

Everything here runs on the proxy's event loop, so no locks: a pick and the in-flight
increment that follows it happen without an ``await`` in between.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvferry.entrypoints.proxy.errors import NoHealthyInstanceError
from kvferry.entrypoints.proxy.prefix_index import RouteKey

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Instance:
    url: str
    role: str
    healthy: bool = True  # optimistic until the first health check says otherwise
    in_flight: int = 0
    last_error: str | None = None
    num_requests: int = 0
    instance_id: str | None = None  # the run of the server last seen healthy (its /health)
    restarts: int = 0  # times a healthy answer came from another run than the last one
    # Layer-wise P/D (layerwise.py): the instance's /v1/kv_transfer/source, and the run it
    # was asked of (asked again once another run answers /health).
    stream_source: dict[str, Any] | None = None
    stream_source_asked: bool = False
    stream_source_run: str | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "error": self.last_error,
            "restarts": self.restarts,
        }


class Policy(Protocol):
    def pick(
        self, instances: Sequence[Instance], candidates: Collection[Instance], route: RouteKey | None = None
    ) -> Instance:
        """One of ``candidates`` (non-empty, all in ``instances``); ``route``: the request's
        prompt, for policies that place requests by where their KV is."""
        ...


class RoundRobin:
    """Each instance in turn, skipping those that are not candidates."""

    def __init__(self) -> None:
        self._next = 0

    def pick(
        self, instances: Sequence[Instance], candidates: Collection[Instance], route: RouteKey | None = None
    ) -> Instance:
        n = len(instances)
        for k in range(n):
            i = (self._next + k) % n
            if instances[i] in candidates:
                self._next = i + 1
                return instances[i]
        raise AssertionError("pick() needs at least one candidate")


class LeastLoaded:
    """The candidate with the fewest in-flight requests; ties go round-robin."""

    def __init__(self) -> None:
        self._next = 0

    def pick(
        self, instances: Sequence[Instance], candidates: Collection[Instance], route: RouteKey | None = None
    ) -> Instance:
        n = len(instances)
        order = {id(inst): (i - self._next) % n for i, inst in enumerate(instances)}
        best = min(candidates, key=lambda inst: (inst.in_flight, order[id(inst)]))
        self._next = instances.index(best) + 1
        return best


POLICY_CLASSES: dict[str, type[Policy]] = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}


def make_policy(name: str) -> Policy:
    return POLICY_CLASSES[name]()


class InstancePool:
    """The instances of one role, a selection policy and in-flight bookkeeping."""

    def __init__(self, role: str, urls: Sequence[str], policy: Policy) -> None:
        self.role = role
        self.instances = [Instance(url, role) for url in urls]
        self.policy = policy

    def acquire(self, exclude: Collection[Instance] = (), route: RouteKey | None = None) -> Instance:
        """Pick a healthy instance (not in ``exclude``) and count a request in flight on it."""
        candidates = [i for i in self.instances if i.healthy and i not in exclude]
        if not candidates:
            raise NoHealthyInstanceError(self._none_healthy_message(exclude))
        inst = self.policy.pick(self.instances, candidates, route)
        inst.in_flight += 1
        inst.num_requests += 1
        return inst

    def release(self, inst: Instance) -> None:
        assert inst.in_flight > 0, f"release without acquire on {inst.url}"
        inst.in_flight -= 1

    def mark(self, inst: Instance, healthy: bool, error: str | None = None) -> None:
        if inst.healthy != healthy:
            if healthy:
                logger.info("%s instance %s is healthy again", self.role, inst.url)
            else:
                logger.warning("%s instance %s is unhealthy: %s", self.role, inst.url, error)
        inst.healthy = healthy
        inst.last_error = error

    def seen_run(self, inst: Instance, instance_id: str | None) -> None:
        """A healthy answer named ``instance_id``: another run than before is a restart."""
        if instance_id is None:
            return
        if inst.instance_id is not None and inst.instance_id != instance_id:
            inst.restarts += 1
            logger.info("%s instance %s was restarted (%d restarts)", self.role, inst.url, inst.restarts)
        inst.instance_id = instance_id

    @property
    def num_healthy(self) -> int:
        return sum(inst.healthy for inst in self.instances)

    def _none_healthy_message(self, exclude: Collection[Instance]) -> str:
        down = [f"{i.url} ({i.last_error or 'unhealthy'})" for i in self.instances if i not in exclude]
        tried = [i.url for i in exclude]
        parts = [f"no healthy {self.role} instance"]
        if tried:
            parts.append(f"tried: {', '.join(tried)}")
        if down:
            parts.append(f"unhealthy: {', '.join(down)}")
        return "; ".join(parts)
