"""The proxy's Prometheus metrics, in a registry of its own (one per app)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from enum import Enum, StrEnum

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvferry.entrypoints.proxy.pool import InstancePool

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class MoveCause(StrEnum):
    """Why a request went to another instance of its role before any answer."""

    REFUSED = "refused"  # the instance refused the connection: it never got the request
    LOST = "lost"  # it closed the connection, then refused a new one: it died holding it


class _PoolCollector(Collector):
    """Health and in-flight requests per instance, read from the pools at scrape time."""

    def __init__(self, pools: Sequence[InstancePool], cached_blocks: Callable[[str], int] | None) -> None:
        self._pools = pools
        self._cached_blocks = cached_blocks  # --policy prefix: blocks the index knows an instance holds

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        healthy = GaugeMetricFamily(
            "kvferry_proxy:instance_healthy",
            "1 if the instance passed its last health check",
            labels=["role", "instance"],
        )
        in_flight = GaugeMetricFamily(
            "kvferry_proxy:instance_in_flight",
            "requests in flight on the instance",
            labels=["role", "instance"],
        )
        restarts = CounterMetricFamily(
            "kvferry_proxy:instance_restarts",
            "times the instance answered its health check from a new run of its server",
            labels=["role", "instance"],
        )
        counts = GaugeMetricFamily(
            "kvferry_proxy:instances",
            "instances of the role that passed (up) or failed (down) their last health check",
            labels=["role", "state"],
        )
        cached = GaugeMetricFamily(
            "kvferry_proxy:instance_cached_blocks",
            "--policy prefix: KV blocks the proxy's index knows the instance holds (from its KV events)",
            labels=["role", "instance"],
        )
        for pool in self._pools:
            for inst in pool.instances:
                healthy.add_metric([pool.role, inst.url], float(inst.healthy))
                in_flight.add_metric([pool.role, inst.url], float(inst.in_flight))
                restarts.add_metric([pool.role, inst.url], float(inst.restarts))
                if self._cached_blocks is not None:
                    cached.add_metric([pool.role, inst.url], float(self._cached_blocks(inst.url)))
            counts.add_metric([pool.role, "up"], float(pool.num_healthy))
            counts.add_metric([pool.role, "down"], float(len(pool.instances) - pool.num_healthy))
        yield from (healthy, in_flight, restarts, counts)
        if self._cached_blocks is not None:
            yield cached


class PrefillPath(str, Enum):
    """Where a leg's prompt is computed."""

    REMOTE = "remote"  # a prefill instance, its KV transferred to the decoder
    STREAMED = "streamed"  # a prefill instance, its KV read layer by layer as it computes
    LOCAL = "local"  # the decoder itself (short or mostly cached on the decoders)
    LOCAL_ON_PREFILLER = "local_on_prefiller"  # a local leg a prefiller answers whole


class ProxyMetrics:
    def __init__(
        self, pools: Sequence[InstancePool], cached_blocks: Callable[[str], int] | None = None
    ) -> None:
        """``cached_blocks``: with --policy prefix, the blocks the index knows an instance
        (by URL) holds, exported per instance."""
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(pools, cached_blocks))
        self._requests = Counter(
            "kvferry_proxy:requests",
            "client requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self._upstream = Counter(
            "kvferry_proxy:upstream_requests",
            "requests sent to instances, by outcome (HTTP status, connect_error, error)",
            ["role", "instance", "outcome"],
            registry=self.registry,
        )
        self._prefill = Histogram(
            "kvferry_proxy:prefill_seconds",
            "time from receiving a request to the prefill's answer",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._first_chunk = Histogram(
            "kvferry_proxy:time_to_first_chunk_seconds",
            "time from receiving a streamed request to its first content chunk",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

        self._early = Counter(
            "kvferry_proxy:early_first_tokens",
            "streamed legs whose first token went to the client as soon as the prefill answered, "
            "before the decoder's stream",
            registry=self.registry,
        )

        self._failovers = Counter(
            "kvferry_proxy:decode_failovers",
            "answers continued on another decoder after theirs, which had accepted the request, "
            "was lost; by streamed or not",
            ["mode"],
            registry=self.registry,
        )

        self._paths = Counter(
            "kvferry_proxy:prefill_path",
            "legs by where their prompt was computed: on a prefill instance (remote; streamed: "
            "its KV read layer by layer), on the decoder itself (local: --local-prefill-tokens, "
            "--idle-decoder-prefills) or, answered whole, on a prefill instance "
            "(local_on_prefiller: --local-on-prefillers)",
            ["path"],
            registry=self.registry,
        )

        self._moved = Counter(
            "kvferry_proxy:requests_moved",
            "requests an instance never answered (refused, or lost before its status line) "
            "sent to another instance of the role instead",
            ["role", "cause"],
            registry=self.registry,
        )

    def prefill_path(self, path: PrefillPath) -> None:
        self._paths.labels(path.value).inc()

    def moved(self, role: str, cause: MoveCause) -> None:
        self._moved.labels(role, cause.value).inc()

    def early_first_token(self) -> None:
        self._early.inc()

    def failover(self, streamed: bool) -> None:
        self._failovers.labels("stream" if streamed else "complete").inc()

    def request(self, endpoint: str, status: int) -> None:
        self._requests.labels(endpoint, str(status)).inc()

    def upstream(self, role: str, url: str, outcome: str) -> None:
        self._upstream.labels(role, url, outcome).inc()

    def prefill_done(self, seconds: float) -> None:
        self._prefill.observe(seconds)

    def first_chunk(self, seconds: float) -> None:
        self._first_chunk.observe(seconds)
