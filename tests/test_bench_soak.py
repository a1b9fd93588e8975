"""`kvferry bench soak`, short: 8 streaming clients for 20 s against `kvferry disagg` on the
tiny llama, mixing normal, aborted and bad requests. Every normal answer equals its
prompt's greedy answer asked alone, bad requests are refused with a 4xx, nothing else
happens, once the load stops no instance holds a KV block, and memory was sampled by
instance during the load."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvferry_bench import soak

# slow: a 20 s soak against `kvferry disagg` (make test-all only)
pytestmark = pytest.mark.slow


def test_short_soak_is_clean(tiny_llama: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    soak.add_args(parser)
    output = tmp_path / "soak.json"
    argv = [str(tiny_llama), "--clients", "8", "--duration", "20", "--num-prompts", "6"]
    argv += [
        "--engine-args",
        "--kv-cache-memory 0.005 --enforce-eager",
        "--startup-timeout",
        "180",
        "--rss-every",
        "5",
    ]
    argv += ["--log-dir", str(tmp_path / "logs"), "--output", str(output)]
    summary = soak.run(parser.parse_args(argv))
    assert json.loads(output.read_text()) == summary
    outcomes = summary["outcomes"]
    assert outcomes.get("normal:ok", 0) > 8, outcomes
    assert outcomes.get("aborted:ok", 0) > 0 and outcomes.get("bad:refused", 0) > 0, outcomes
    assert summary["unexpected"] == {}
    assert summary["greedy_mismatches"] == 0, summary["mismatch_examples"]
    assert len(summary["held_blocks"]) == 2 and not any(summary["held_blocks"].values())
    assert summary["rss_start_bytes"] > 0 and summary["rss_end_bytes"] > 0
    samples = summary["memory_samples"]
    assert len(samples) >= 2 and all(s["rss"] > 0 and s["kv_resident"] >= 0 for s in samples)
    roles = {name.split()[0] for name in samples[-1]["by_process"]}
    assert roles == {"launcher", "proxy", "prefill", "decode"}, samples[-1]["by_process"]
