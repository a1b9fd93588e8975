"""The soak's memory record: the deployment's resident memory sampled during the load, by
instance, beside the KV memory its instances committed, and the trend of both.

Resident memory that keeps growing under a steady load is a leak; KV pages the engines
commit (an elastic KV allocator maps them as they are first used) grow to at most the KV
cache's size, so the record also shows the resident memory without them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from kvferry_bench.soak_probe import kv_resident, rss_by_child


@dataclass(frozen=True)
class MemorySample:
    seconds: float  # since the load started
    by_process: dict[str, int]  # resident bytes: the launcher, each instance's process tree
    kv_resident: int  # KV bytes committed on all the instances

    @property
    def rss(self) -> int:
        return sum(self.by_process.values())

    @property
    def rss_without_kv(self) -> int:
        return self.rss - self.kv_resident


def take_sample(pid: int, urls: list[str], seconds: float) -> MemorySample:
    return MemorySample(round(seconds, 1), rss_by_child(pid), kv_resident(urls))


async def sample_memory(
    pid: int, urls: list[str], every_s: float, deadline: float, samples: list[MemorySample]
) -> None:
    """A sample every ``every_s`` seconds until ``deadline`` (and one at the start)."""
    begin = time.monotonic()
    while time.monotonic() < deadline:
        samples.append(await asyncio.to_thread(take_sample, pid, urls, time.monotonic() - begin))
        await asyncio.sleep(min(every_s, max(0.0, deadline - time.monotonic())))


def slope_per_min(points: list[tuple[float, int]]) -> float:
    """Least-squares slope of (seconds, bytes) points, in bytes per minute."""
    if len(points) < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_b = sum(b for _, b in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return 0.0
    return 60.0 * sum((t - mean_t) * (b - mean_b) for t, b in points) / spread


def memory_summary(samples: list[MemorySample]) -> dict[str, object]:
    """Trends over the second half of the load (the first includes the warm-up: allocator
    arenas, caches and connections filling), each instance's growth, every sample."""
    if not samples:
        return {}
    first, last, half = samples[0], samples[-1], samples[len(samples) // 2 :]
    return {
        "rss_trend_second_half_bytes_per_min": round(slope_per_min([(s.seconds, s.rss) for s in half])),
        "rss_without_kv_trend_second_half_bytes_per_min": round(
            slope_per_min([(s.seconds, s.rss_without_kv) for s in half])
        ),
        "rss_peak_bytes": max(s.rss for s in samples),
        "rss_growth_by_process_bytes": {
            name: last.by_process.get(name, 0) - rss for name, rss in first.by_process.items()
        },
        "kv_resident_start_end_bytes": [first.kv_resident, last.kv_resident],
        "memory_samples": [
            {"s": s.seconds, "rss": s.rss, "kv_resident": s.kv_resident, "by_process": s.by_process}
            for s in samples
        ],
    }
