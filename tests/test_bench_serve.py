"""`kvferry bench serve` on tiny settings against a fake streaming server (real HTTP):
valid JSON with every metric, labelled runs merged into one file, and a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from kvferry_bench.cli import build_parser
from tests.proxy_fakes import ANSWER_CHUNKS, FakeInstance, serve_in_thread

METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms", "second_token_ms", "first_itl_ms")


def _bench(url: str, out: Path, label: str, *rates: str, more: tuple[str, ...] = ()) -> dict:
    argv = ["serve", "--url", url, "--model", "fake", "--num-prompts", "4", "--input-len", "8"]
    argv += ["--output-len", "3", "--label", label, "--output", str(out), "--request-rate", *rates, *more]
    args = build_parser().parse_args(argv)
    return args.func(args)


def test_bench_serve_writes_labelled_runs_and_a_plot(tmp_path: Path) -> None:
    fake = FakeInstance("bench")
    out = tmp_path / "serve.json"
    with serve_in_thread(fake.app) as url:
        _bench(url, out, "colocated", "100", "inf")
        _bench(url, out, "pd", "100")
        _bench(url, out, "colocated", "inf")  # replaces the first colocated run
    doc = json.loads(out.read_text())
    assert [run["label"] for run in doc["runs"]] == ["pd", "colocated"]
    pd, colocated = doc["runs"]
    assert [r["request_rate"] for r in pd["results"]] == [100.0]
    assert [r["request_rate"] for r in colocated["results"]] == ["inf"]
    result = pd["results"][0]
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 4 * len(ANSWER_CHUNKS)
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    for key in METRICS:
        assert set(result[key]) == {"mean", "p50", "p99"}
        assert 0 < result[key]["p50"] <= result[key]["p99"]
    assert result["ttft_ms"]["p99"] < result["second_token_ms"]["p99"] <= result["e2el_ms"]["p99"]
    second, first, gap = (result[key]["mean"] for key in ("second_token_ms", "ttft_ms", "first_itl_ms"))
    assert abs(second - first - gap) < 1e-6 * second  # the gap is per request, its mean their difference
    assert len(fake.requests) == 4 * (4 + 1)  # 4 rate runs: 4 prompts and a warm-up each
    body = fake.requests[-1]
    assert (
        body["stream"] and body["ignore_eos"] and body["max_tokens"] == 3 and len(body["prompt"].split()) == 8
    )
    assert out.with_suffix(".png").stat().st_size > 10_000
    measured = [r["prompt"] for r in fake.requests if r["max_tokens"] == 3]  # not the warm-ups
    first_run_prompts, second_rate_prompts = set(measured[:4]), set(measured[4:8])
    assert not first_run_prompts & second_rate_prompts  # a prefix cache cannot serve one rate from another


def test_bench_serve_counts_failures(tmp_path: Path) -> None:
    fake = FakeInstance("down")
    fake.fail_status = 503
    out = tmp_path / "serve.json"
    with serve_in_thread(fake.app) as url:
        doc = _bench(url, out, "down", "inf")
    result = doc["runs"][0]["results"][0]
    assert result["completed"] == 0 and result["failed"] == 4
    assert result["errors"] and "HTTP 503" in result["errors"][0]


def test_bench_serve_constrains_every_request_to_a_json_schema(tmp_path: Path) -> None:
    fake = FakeInstance("bench")
    schema = {"type": "array", "items": {"type": "string"}}
    with serve_in_thread(fake.app) as url:
        doc = _bench(
            url, tmp_path / "serve.json", "schema", "inf", more=("--json-schema", json.dumps(schema))
        )
    assert doc["runs"][0]["json_schema"] == json.dumps(schema)
    assert len(fake.requests) == 4 + 1
    assert all(body["structured_outputs"] == {"json": schema} for body in fake.requests)  # warm-up too
