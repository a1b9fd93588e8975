"""`kvferry bench spec-decode` on the tiny model: both engines time every workload, the
drafted answers equal the plain ones, drafts were kept where the answer loops, and the
result lands as JSON and a PNG. Eager (--enforce-eager): the subject is the bench."""

from __future__ import annotations

import json
from pathlib import Path

from kvferry_bench.cli import build_parser


def test_bench_spec_decode_times_both_engines_on_every_workload(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    argv = ["spec-decode", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "0.01"]
    argv += ["--enforce-eager", "--decode-len", "24", "--repeats", "2", "--output", str(out)]
    args = build_parser().parse_args(argv)
    args.func(args)
    result = json.loads(out.read_text())
    assert result["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    assert set(result["workloads"]) == {"looping", "story", "code-edit"}
    for row in result["workloads"].values():
        assert row["answers_equal"]
        assert row["plain"]["min"] > 0 and row["drafted"]["min"] > 0
    assert sum(row["drafts_kept"] for row in result["workloads"].values()) > 0
    assert out.with_suffix(".png").stat().st_size > 5_000
