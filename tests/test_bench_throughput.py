"""`kvferry bench throughput` on the tiny model: kvferry and HF transformers generate
every requested token, greedy and sampled, and the result lands as JSON and a PNG. The
kvferry engine runs eager (--enforce-eager)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvferry_bench.cli import build_parser

# slow: generates with kvferry and HF transformers, writes a PNG (make test-all only)
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--top-p", "0.9"]])
def test_bench_throughput_counts_every_generated_token(tiny_llama: Path, tmp_path: Path, sampling) -> None:
    out = tmp_path / "throughput.json"
    # eager: the subject is the counting and the output files, not the compiled forward
    argv = ["throughput", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "0.01"]
    argv += ["--enforce-eager", "--num-prompts", "4", "--input-len", "8", "--output-len", "5"]
    argv += ["--hf-reference"]
    args = build_parser().parse_args([*argv, *sampling, "--output", str(out)])
    args.func(args)
    result = json.loads(out.read_text())
    assert result["temperature"] == (0.8 if sampling else 0.0)
    for engine in ("kvferry", "hf_transformers"):
        assert result[engine]["generated_tokens"] == 4 * 5
        assert result[engine]["tokens_per_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 5_000
