"""`kvferry bench startup` on the tiny model: one `kvferry generate` start with its answer
and its start-up broken down by phase (a second start following a stored decision is
tests/test_startup.py's), then `kvferry serve` timed to /health and to its first answer;
JSON and a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvferry.engine.startup_report import StartupPhase
from kvferry_bench.cli import build_parser

# slow: starts three engine processes (make test-all only)
pytestmark = pytest.mark.slow


def test_bench_startup_breaks_every_start_down(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    argv = ["startup", "--model", str(tiny_llama), "--prompt", "the cat", "--max-tokens", "3"]
    args = build_parser().parse_args([*argv, "--starts", "1", "--capture", "never", "--output", str(out)])
    args.func(args)
    result = json.loads(out.read_text())
    assert [start["start"] for start in result["generate"]] == [1]
    for start in result["generate"]:
        assert list(start["phases_s"]) == [phase.value for phase in StartupPhase] + ["compiling"]
        assert start["phases_s"]["compiling"] == 0.0 and start["answer"]
        assert 0 < start["startup_s"] < start["first_answer_s"] <= start["answer_s"] + 1.0
        assert "captured forward: off (--enforce-eager / --capture never)" in start["capture"]
    assert 0 < result["serve"]["health_s"] < result["serve"]["first_answer_s"]
    assert out.with_suffix(".png").stat().st_size > 5_000
