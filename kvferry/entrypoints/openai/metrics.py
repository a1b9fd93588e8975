"""Prometheus metrics of one server: its own CollectorRegistry (never the global one).

Request-level metrics (counters by finish reason, TTFT / inter-token / end-to-end latency
histograms, token counters) come from the engine's ``IterationStats`` through
``PrometheusStatLogger``. Engine gauges (running, waiting, KV usage, blocks) and the core's
cumulative counters (prefix cache queries/hits, preemptions) are read from the engine's
latest stats at scrape time by ``EngineStatsCollector``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvferry.engine.async_engine import AsyncEngine, IterationStats
from kvferry.kv.usage import KVGroupStats, KVMemoryStats

logger = logging.getLogger(__name__)

PREFIX = "kvferry:"
FINISH_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    7.5,
    10,
    20,
    40,
    80,
)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10, 20)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 300)


class PrometheusStatLogger:
    """Turns the engine's IterationStats into counters and histograms."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = ["model_name"]
        self.requests = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            labels + ["finished_reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prefilled prompt tokens.", labels, registry=registry
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens.", labels, registry=registry
        )
        self.ttft = _histogram(registry, "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = _histogram(registry, "inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.e2e = _histogram(registry, "e2e_request_latency_seconds", "Request latency.", E2E_BUCKETS)
        self._model = model_name
        for reason in FINISH_REASONS:  # export zeros from the start
            self.requests.labels(model_name, reason)

    def record(self, stats: IterationStats) -> None:
        m = self._model
        if stats.num_prompt_tokens:
            self.prompt_tokens.labels(m).inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.labels(m).inc(stats.num_generation_tokens)
        for t in stats.time_to_first_tokens:
            self.ttft.labels(m).observe(t)
        for t in stats.inter_token_latencies:
            self.itl.labels(m).observe(t)
        for fin in stats.finished:
            self.requests.labels(m, fin.finish_reason).inc()
            self.e2e.labels(m).observe(fin.e2e_latency)


def _histogram(registry: CollectorRegistry, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
    return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=registry)


class EngineStatsCollector(Collector):
    """Gauges and cumulative counters straight from the engine core's stats."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats
        gauges: tuple[tuple[str, str, float], ...] = (
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", s.kv_cache_usage),
            ("num_free_blocks", "Free KV cache blocks.", s.num_free_blocks),
            ("num_blocks", "KV cache blocks in total.", s.num_blocks),
            ("engine_alive", "1 while the engine core process serves.", 0 if self.engine.is_dead else 1),
        )
        counters: list[tuple[str, str, float]] = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("num_preemptions", "Requests preempted.", s.num_preemptions),
            (
                "kv_event_batches_published",
                "KV event batches (one per step with events) queued for the publisher.",
                s.kv_event_batches_published,
            ),
            (
                "kv_event_batches_dropped",
                "KV event batches dropped because the publisher's queue was full (max_queue_size).",
                s.kv_event_batches_dropped,
            ),
            (
                "spec_decode_num_draft_tokens",
                "Draft tokens verified (--speculative-config).",
                s.spec_decode_num_draft_tokens,
            ),
            ("spec_decode_num_accepted_tokens", "Draft tokens kept.", s.spec_decode_num_accepted_tokens),
        ]
        gauges += _kv_memory_gauges(s.kv_memory)
        counters += [
            (
                "kv_pages_mapped",
                "KV memory pages the workers were told to map.",
                s.kv_memory.pages_mapped_total,
            ),
            ("kv_pages_returned", "KV memory pages returned to the host.", s.kv_memory.pages_returned_total),
        ]
        for key, val in sorted((s.kv_connector or {}).items()):
            counters.append(("kv_connector_" + key, f"KV connector counter {key}.", val))
        for name, doc, val in gauges:
            yield self._sample(GaugeMetricFamily, name, doc, val)
        for name, doc, val in counters:
            yield self._sample(CounterMetricFamily, name, doc, val)
        yield from self._kv_groups(s.kv_groups)

    def _kv_groups(self, groups: list[KVGroupStats]) -> Iterator[Metric]:
        """Per KV cache group (labels group and kind): blocks and bytes in use, and blocks
        saved by window clipping."""
        labels = ["model_name", "group", "kind"]
        blocks = GaugeMetricFamily(
            PREFIX + "kv_group_blocks", "KV blocks a group's requests hold.", labels=labels
        )
        nbytes = GaugeMetricFamily(
            PREFIX + "kv_group_bytes", "KV memory a group's blocks take.", labels=labels
        )
        clipped = CounterMetricFamily(
            PREFIX + "kv_group_blocks_clipped",
            "Blocks a sliding window saved (vs full attention).",
            labels=labels,
        )
        for g in groups:
            key = [self.model_name, str(g.group), g.kind]
            blocks.add_metric(key, float(g.blocks_in_use))
            nbytes.add_metric(key, float(g.bytes_in_use))
            clipped.add_metric(key, float(g.blocks_clipped_total))
        yield from (blocks, nbytes, clipped)

    def _sample(
        self, family: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, val: float
    ) -> Metric:
        metric = family(PREFIX + name, doc, labels=["model_name"])
        metric.add_metric([self.model_name], float(val))
        return metric


def _kv_memory_gauges(m: KVMemoryStats) -> tuple[tuple[str, str, float], ...]:
    return (
        (
            "kv_reserved_bytes",
            "KV capacity reserved, all ranks (address space when elastic).",
            m.reserved_bytes,
        ),
        (
            "kv_resident_bytes",
            "KV memory committed now, all ranks (all of it when eager).",
            m.committed_bytes,
        ),
        ("kv_pages_resident", "KV memory pages mapped now.", m.pages_mapped),
        ("kv_pool_size_bytes", "The shared KV memory pool's budget (0: no pool).", m.pool_size_bytes),
        ("kv_pool_used_bytes", "Bytes of the shared pool held by all its engines.", m.pool_used_bytes),
        ("kv_pool_held_bytes", "Bytes of the shared pool this engine holds.", m.pool_held_bytes),
    )


def make_registry(engine: AsyncEngine, model_name: str) -> CollectorRegistry:
    """A registry for one app; registers the stat logger on the engine."""
    registry = CollectorRegistry()
    engine.add_stat_logger(PrometheusStatLogger(registry, model_name))
    registry.register(EngineStatsCollector(engine, model_name))
    return registry
