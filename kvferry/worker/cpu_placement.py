"""Which CPU cores a rank runs on and how many threads its ops use.

On a CPU, every torch op splits over an OpenMP team that meets at a barrier when the op
ends. When two engine processes (a prefill and a decode instance, or TP ranks) share
cores, each barrier waits until every thread of the team is scheduled again, and ops
slow down several times (measured: a mul on [1500, 576] took 8 ms with 2 threads while
another process was busy, against 0.97 ms with 1). So an engine instance may be given
its own cores (`ParallelConfig.cpu_cores`); each TP rank then takes an equal, disjoint
share, pins itself to it and runs as many threads as it has cores.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kvferry.errors import ConfigError

if TYPE_CHECKING:  # the launcher imports this module; keep torch out of it
    from kvferry.config import ParallelConfig

logger = logging.getLogger(__name__)


def parse_core_list(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6): the Linux cpu-list syntax (as in taskset -c)."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ConfigError(f"bad CPU core list {text!r}: use e.g. '0-3,6'") from None
        if first < 0 or last < first:
            raise ConfigError(f"bad CPU core range {part!r} in {text!r}")
        cores.extend(range(first, last + 1))
    if len(set(cores)) != len(cores):
        raise ConfigError(f"CPU core list {text!r} names a core twice")
    return tuple(cores)


def format_core_list(cores: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(core) for core in cores)


def rank_cores(cores: tuple[int, ...], rank: int, world_size: int) -> tuple[int, ...]:
    """Rank `rank`'s share of `cores`: an equal contiguous slice (the remainder unused)."""
    share = len(cores) // world_size
    if share == 0:
        raise ConfigError(f"{len(cores)} CPU cores cannot give each of {world_size} TP ranks one")
    return cores[rank * share : (rank + 1) * share]


def available_cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def place_rank(parallel: ParallelConfig, rank: int, world_size: int) -> int:
    """Pin this process to its cores (if the instance has some) and set its torch thread
    count; the thread count it chose. Call before the model loads (loading reads it)."""
    import torch

    if parallel.cpu_cores is not None:
        unknown = set(parallel.cpu_cores) - set(available_cores())
        if unknown:
            raise ConfigError(f"CPU cores {sorted(unknown)} are not available to this process")
        cores = rank_cores(parallel.cpu_cores, rank, world_size)
        os.sched_setaffinity(0, cores)
        where, default_threads = format_core_list(cores), len(cores)
    elif world_size > 1:
        where, default_threads = "any core", max(1, len(available_cores()) // world_size)
    else:  # nothing asked: the process's own setting (torch's default, or its caller's)
        where, default_threads = "any core", torch.get_num_threads()
    threads = parallel.cpu_threads or default_threads
    torch.set_num_threads(threads)
    logger.info("rank %d: %d torch threads on %s", rank, threads, where)
    return threads
