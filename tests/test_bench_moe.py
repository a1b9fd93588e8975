"""`kvferry bench moe` on the tiny Qwen3-MoE: kvferry and HF transformers generate every
requested token from the same prompts, greedy outputs agree, and the result lands as JSON
and a PNG."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kvferry_bench.cli import build_parser


def test_bench_moe_times_kvferry_and_hf_on_the_same_prompts(
    tiny_moe: Callable[[str], Path], tmp_path: Path
) -> None:
    out = tmp_path / "moe.json"
    argv = ["moe", str(tiny_moe("qwen3_moe")), "--num-prompts", "3", "--input-len", "8"]
    args = build_parser().parse_args([*argv, "--output-len", "4", "--output", str(out)])
    args.func(args)
    result = json.loads(out.read_text())
    (entry,) = result["models"]
    assert entry["architecture"] == "Qwen3MoeForCausalLM"
    for engine in ("kvferry", "hf_transformers"):
        assert entry[engine]["generated_tokens"] == 3 * 4
        assert entry[engine]["tokens_per_s"] > 0
    assert entry["identical_prompts"] == 3
    assert out.with_suffix(".png").stat().st_size > 5_000
