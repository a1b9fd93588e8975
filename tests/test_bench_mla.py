"""`kvferry bench mla` on tiny settings: the tests' tiny DeepSeek shape (read from a
config.json), every phase in both forms through the real latent-attention operator; the
JSON holds each case's rounds, the faster form and how far the two forms' outputs differ
(they compute the same attention), and a PNG beside it."""

from __future__ import annotations

import json
from pathlib import Path

from kvferry_bench.cli import build_parser
from tests.fixtures.tiny_moe import KV_LORA_RANK, QK_ROPE_HEAD_DIM


def test_bench_mla_times_both_forms_of_each_phase_and_they_agree(tmp_path: Path) -> None:
    model = tmp_path / "tiny_mla"
    model.mkdir()
    shape = {"num_attention_heads": 4, "kv_lora_rank": KV_LORA_RANK, "qk_rope_head_dim": QK_ROPE_HEAD_DIM}
    (model / "config.json").write_text(json.dumps(shape | {"qk_nope_head_dim": 16, "v_head_dim": 12}))
    out = tmp_path / "mla.json"
    argv = ["mla", "--model", str(model), "--no-v2-lite", "--contexts", "20", "40", "--batches", "1", "3"]
    argv += ["--chunks", "24", "--repeats", "2", "--iters", "1", "--threads", "1", "--output", str(out)]
    args = build_parser().parse_args(argv)
    args.func(args)
    doc = json.loads(out.read_text())
    (result,) = doc["results"]
    assert result["shape"] == {"name": "tiny_mla", "heads": 4, "rank": 24, "rope": 8, "nope": 16, "value": 12}
    labels = [case["label"] for case in result["cases"]]
    assert labels == [
        "decode b1 ctx20",
        "decode b1 ctx40",
        "decode b3 ctx20",
        "decode b3 ctx40",
        "prefill 24",
    ]
    for case in result["cases"]:
        assert case["max_abs_diff"] < 1e-4  # the same attention, summed in another order
        for form in ("absorbed", "decompressed"):
            assert len(case[form]["rounds_ms"]) == 2 and case[form]["median_ms"] > 0
        assert case["faster"] in ("absorbed", "decompressed")
    assert doc["host"]["threads"] == 1
    assert out.with_suffix(".png").stat().st_size > 10_000
