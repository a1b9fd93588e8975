"""`kvferry bench hybrid` on tiny settings: the tiny Gemma 3 and the same weights forced to
full attention, real NIXL engines and a real scheduler; the JSON holds the bytes each
variant's decoder read (exactly the window-visible blocks vs every block of every layer),
per KV cache group and in all, the capacity counts (more requests at once with sliding
windows) with the KV each group held at the peak, and a PNG beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvferry.errors import ConfigError
from kvferry_bench.cli import build_parser
from kvferry_bench.hybrid import has_sliding_layers, variant_config
from tests.fixtures.tiny_hybrid import WINDOW, build_hybrid_model

# slow: runs the hybrid bench: real NIXL engines for two model variants (make test-all only)
pytestmark = pytest.mark.slow

PAGE = 16 * 2 * 16 * 4 * 2  # a layer's block: 16 tokens, 2 KV heads of 16 floats, K and V


def test_bench_hybrid_writes_bytes_times_and_capacity_of_both_variants(tmp_path: Path) -> None:
    pytest.importorskip("nixl._api")
    model = build_hybrid_model("gemma3", tmp_path / "gemma3")
    out = tmp_path / "hybrid.json"
    argv = ["hybrid", str(model), "--prompt-tokens", "100", "--iters", "1", "--requests", "8"]
    argv += ["--max-tokens", "4", "--kv-budget-mib", "0.5", "--output", str(out)]
    args = build_parser().parse_args(argv)
    args.func(args)
    doc = json.loads(out.read_text())
    hybrid, full = doc["variants"]["hybrid"], doc["variants"]["full"]
    # 99 tokens read: 7 blocks; the next token's window (tokens 90-99) spans blocks 5 and 6.
    assert hybrid["transfer"]["bytes_per_request"] == (7 + 2 * 2) * 2 * PAGE
    assert full["transfer"]["bytes_per_request"] == 7 * 6 * PAGE
    for variant in (hybrid, full):
        assert variant["transfer"]["transfer_ms_median"] > 0
        assert variant["capacity"]["requests"] == 8
    assert [g["kind"] for g in full["capacity"]["groups"]] == ["full"]
    assert sorted(g["kind"] for g in hybrid["capacity"]["groups"]) == [
        "full",
        f"window {WINDOW}",
        f"window {WINDOW}",
    ]
    # Per group: the next token's window-visible blocks of the 99 loaded tokens, each the
    # group's layers' pages; they add up to the bytes the decoder read.
    assert _blocks_and_pages(*_transfer_groups(hybrid)) == [(2, 2 * PAGE), (2, 2 * PAGE), (7, 2 * PAGE)]
    assert _blocks_and_pages(*_transfer_groups(full)) == [(7, 6 * PAGE)]
    # 0.5 MiB: 21 blocks of 6 layers (3 requests of 7), or 63 of 2 (11 blocks a request).
    assert full["capacity"]["max_running"] == 3
    assert hybrid["capacity"]["max_running"] == 5
    # At the peak (every request admitted in the first step, its 100 tokens computed): 7
    # blocks a request in the full group, the window-visible 2 in each sliding group.
    assert _blocks_and_pages(*_capacity_groups(hybrid)) == [(10, 2 * PAGE), (10, 2 * PAGE), (35, 2 * PAGE)]
    assert _blocks_and_pages(*_capacity_groups(full)) == [(21, 6 * PAGE)]
    assert doc["ratios"]["running_hybrid_over_full"] == pytest.approx(5 / 3)
    assert out.with_suffix(".png").stat().st_size > 10_000


def _blocks_and_pages(groups: list[dict], total: int) -> list[tuple[int, int]]:
    """(blocks, page bytes) per KV cache group, after checking that each group's bytes are
    their product and that the groups add up to `total`."""
    assert [g["group"] for g in groups] == list(range(len(groups)))
    assert all(g["bytes"] == g["blocks"] * g["page_bytes"] for g in groups)
    assert sum(g["bytes"] for g in groups) == total
    return [(g["blocks"], g["page_bytes"]) for g in groups]


def _transfer_groups(variant: dict) -> tuple[list[dict], int]:
    assert variant["transfer"]["groups_add_up"]
    return variant["transfer"]["groups"], variant["transfer"]["bytes_per_request"]


def _capacity_groups(variant: dict) -> tuple[list[dict], int]:
    return variant["capacity"]["groups"], variant["capacity"]["kv_bytes_at_peak"]


def test_variant_configs_force_full_attention_each_way_a_config_states_windows() -> None:
    gemma = {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 10,
        "max_position_embeddings": 64,
    }
    mistral = {"sliding_window": 4096, "max_position_embeddings": 32768}
    qwen = {"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 2}
    multimodal = {"text_config": dict(gemma), "architectures": ["Gemma3ForConditionalGeneration"]}
    for config in (gemma, mistral, qwen, multimodal):
        assert has_sliding_layers(config)
        full = variant_config(config, "full", None, 3000)
        assert not has_sliding_layers(full), config
        text = full.get("text_config", full)
        assert text["max_position_embeddings"] >= 3000
    assert variant_config(gemma, "hybrid", 512, 100)["sliding_window"] == 512
    assert variant_config(mistral, "hybrid", None, 100) == mistral  # already long enough
    assert not has_sliding_layers({"max_position_embeddings": 8})
    assert not has_sliding_layers({"layer_types": ["full_attention"] * 2, "sliding_window": 10})


def test_bench_hybrid_refuses_a_model_without_sliding_layers(tmp_path: Path, tiny_llama: Path) -> None:
    from kvferry_bench.hybrid import write_variants

    with pytest.raises(ConfigError, match="no sliding-window layers"):
        write_variants(tiny_llama, tmp_path / "scratch", None, 100)
