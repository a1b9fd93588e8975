"""`kvferry bench pd` end to end on the tiny model: both deployments really start (a
colocated server, then prefill + decode + proxy over NIXL), serve every request, stop,
and land as two labelled runs in one JSON file with a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvferry_bench.cli import build_parser
from kvferry_bench.pd import serve_args


# slow: starts a colocated server, then prefill + decode + proxy (make test-all only)
@pytest.mark.slow
def test_bench_pd_compares_colocated_and_pd_in_one_file(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    argv = ["pd", str(tiny_llama), "--num-prompts", "3", "--input-len", "40", "--output-len", "4"]
    argv += ["--request-rate", "inf", "--output", str(out), "--log-dir", str(tmp_path / "logs")]
    argv += ["--engine-args", "--kv-cache-memory 0.005 --enforce-eager"]
    args = build_parser().parse_args(argv)
    args.func(args)

    doc = json.loads(out.read_text())
    assert [run["label"] for run in doc["runs"]] == ["colocated", "pd"]
    for run in doc["runs"]:
        (result,) = run["results"]
        assert result["completed"] == 3 and result["failed"] == 0, result["errors"]
        assert result["total_input_tokens"] == 3 * 40 and result["total_output_tokens"] == 3 * 4
        assert run["exact_input_len"] and run["deployment"].split()[1] in ("serve", "disagg")
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "prefill-0" in (tmp_path / "logs" / "pd.log").read_text()  # the launcher really ran


def test_bench_pd_passes_the_client_options_to_bench_serve() -> None:
    schema = '{"type": "array", "items": {"type": "string"}}'
    args = build_parser().parse_args(["pd", "m", "--max-concurrency", "1", "--json-schema", schema])
    forwarded = serve_args(args, "pd", "http://127.0.0.1:1", ["python", "-m", "cli", "disagg", "m"])
    assert forwarded.max_concurrency == 1 and forwarded.json_schema == schema
    assert forwarded.deployment == "kvferry disagg m"
