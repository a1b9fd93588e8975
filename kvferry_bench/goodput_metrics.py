"""Pure computations of ``kvferry bench goodput``: percentiles, SLO attainment, goodput, and
the counters read from Prometheus text (an instance's prefix cache, the proxy's paths)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True)
class RequestTiming:
    """One request's latencies in seconds (ok=False: it failed, and meets no objective)."""

    ok: bool
    ttft: float
    tpot: float  # (end-to-end - TTFT) / (output tokens - 1); 0 for a single token
    itls: tuple[float, ...] = ()


def percentiles_ms(values: Sequence[float]) -> dict[str, float]:
    """Mean and nearest-rank p50/p90/p99 of ``values`` (seconds), in ms; zeros when empty."""
    if not values:
        return {"mean": 0.0, **{f"p{q}": 0.0 for q in PERCENTILES}}
    ordered = sorted(values)
    picked = {f"p{q}": 1000 * ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] for q in PERCENTILES}
    return {"mean": 1000 * sum(values) / len(values), **picked}


def meets(timing: RequestTiming, slo: Slo) -> bool:
    return timing.ok and 1000 * timing.ttft <= slo.ttft_ms and 1000 * timing.tpot <= slo.tpot_ms


def attainment(timings: Sequence[RequestTiming], slo: Slo) -> float:
    """The fraction of requests (failed ones included) meeting both objectives."""
    if not timings:
        return 0.0
    return sum(meets(t, slo) for t in timings) / len(timings)


def goodput(attained: Sequence[tuple[float, float]], threshold: float = 0.9) -> float | None:
    """The highest request rate whose attainment is at least ``threshold``; None if none is.
    ``attained``: (rate, attainment) per rate swept."""
    passing = [rate for rate, frac in attained if frac >= threshold]
    return max(passing) if passing else None


@dataclass(frozen=True)
class PrefixCacheCounts:
    queries: float
    hits: float

    def minus(self, before: PrefixCacheCounts) -> PrefixCacheCounts:
        return PrefixCacheCounts(self.queries - before.queries, self.hits - before.hits)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def prefix_cache_counts(metrics_text: str) -> PrefixCacheCounts:
    """An instance's cumulative prefix-cache queries and hits (prompt tokens) from its /metrics."""
    totals = {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0}
    for name, _labels, value in _samples(metrics_text):
        for key in totals:
            if name.endswith(f":{key}_total") or name == f"{key}_total":
                totals[key] += value
    return PrefixCacheCounts(totals["prefix_cache_queries"], totals["prefix_cache_hits"])


def num_blocks(metrics_text: str) -> int:
    """An instance's KV cache blocks in total from its /metrics (kvferry's ``kvferry:num_blocks``,
    or vLLM's ``num_gpu_blocks`` label of ``vllm:cache_config_info``); 0 if absent."""
    total = 0.0
    for name, labels, value in _samples(metrics_text):
        if name == "kvferry:num_blocks":
            total += value
        elif name == "vllm:cache_config_info" and labels.get("num_gpu_blocks", "").isdigit():
            total += int(labels["num_gpu_blocks"])
    return int(total)


def pooled_hit_rate(counts: dict[str, PrefixCacheCounts], prefix: str) -> float | None:
    """The hit rate of the instances whose label starts with ``prefix``, their tokens pooled."""
    pooled = [c for label, c in counts.items() if label.startswith(prefix)]
    return PrefixCacheCounts(sum(c.queries for c in pooled), sum(c.hits for c in pooled)).hit_rate


def prefill_paths(metrics_text: str) -> dict[str, float]:
    """The proxy's legs by path (local / remote) from its /metrics; empty for a lone server."""
    return {
        labels["path"]: value
        for name, labels, value in _samples(metrics_text)
        if name == "kvferry_proxy:prefill_path_total" and "path" in labels
    }


def counts_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}
