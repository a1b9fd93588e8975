"""CPU placement: core lists, per-rank shares, per-instance splits, pinning a process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvferry.config import ParallelConfig
from kvferry.entrypoints.disagg import split_cores
from kvferry.errors import ConfigError
from kvferry.worker.cpu_placement import format_core_list, parse_core_list, rank_cores


def test_core_lists_parse_like_taskset() -> None:
    assert parse_core_list("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_core_list("5") == (5,)
    assert format_core_list((0, 1, 6)) == "0,1,6"


@pytest.mark.parametrize("bad", ["", "a", "3-1", "-1", "0,0", "1-2,2"])
def test_bad_core_lists_are_config_errors(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_core_list(bad)


def test_each_rank_gets_an_equal_disjoint_share() -> None:
    cores = (0, 1, 2, 3, 4)
    assert [rank_cores(cores, r, 2) for r in range(2)] == [(0, 1), (2, 3)]
    with pytest.raises(ConfigError):
        rank_cores((0,), 1, 2)


def test_parallel_config_rejects_impossible_placements() -> None:
    with pytest.raises(ConfigError):
        ParallelConfig(cpu_threads=0)
    with pytest.raises(ConfigError):
        ParallelConfig(tensor_parallel_size=2, cpu_cores=(0,))


def test_instances_get_cores_in_proportion_to_their_ranks() -> None:
    assert split_cores([1, 2], tuple(range(7))) == [(0, 1), (2, 3, 4, 5)]
    assert split_cores([1, 1], (0, 1)) == [(0,), (1,)]
    assert split_cores([1, 1, 1], (0, 1)) == [None, None, None]  # too few: shared


PLACE = """
import os, sys, torch
from kvferry.config import ParallelConfig
from kvferry.worker.cpu_placement import place_rank
cores = tuple(int(c) for c in sys.argv[1].split(","))
threads = place_rank(ParallelConfig(2, "multiproc", cpu_cores=cores), int(sys.argv[2]), 2)
print(sorted(os.sched_getaffinity(0)), threads, torch.get_num_threads())
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_a_rank_pins_itself_to_its_share_and_runs_one_thread_per_core() -> None:
    cores = sorted(os.sched_getaffinity(0))[:2]
    out = subprocess.run(
        [sys.executable, "-c", PLACE, format_core_list(cores), "1"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split("\n")[0] == f"[{cores[1]}] 1 1"


def test_cores_this_process_cannot_use_are_refused() -> None:
    missing = max(os.sched_getaffinity(0)) + 1
    out = subprocess.run(
        [sys.executable, "-c", PLACE, f"{missing},{missing + 1}", "0"], capture_output=True, text=True
    )
    assert out.returncode != 0 and "not available" in out.stderr
