"""`kvferry bench transfer` on tiny settings: two real NIXL agents in two processes, every
moved block checked, valid JSON and a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvferry_bench.cli import build_parser
from kvferry_bench.transfer import Setting, TransferBenchError, settings_of, touched_buffer, verify

# slow: two NIXL agents in two processes (make test-all only)
pytestmark = pytest.mark.slow


def test_bench_transfer_writes_json_and_png(tmp_path: Path) -> None:
    pytest.importorskip("nixl._api")
    out = tmp_path / "transfer.json"
    argv = ["transfer", "--size-mb", "1", "--block-kb", "16", "256", "--iters", "2", "--warmup", "1"]
    args = build_parser().parse_args([*argv, "--output", str(out)])
    args.func(args)
    doc = json.loads(out.read_text())
    assert doc["bench"] == "transfer" and doc["op"] == "READ" and doc["backend"] == "UCX"
    assert [(r["block_kb"], r["descriptors"]) for r in doc["results"]] == [(16, 64), (256, 4)]
    for row in doc["results"]:
        for key in ("nixl_gbps", "nixl_gbps_best", "nixl_prep_ms", "copy_gbps", "index_copy_gbps"):
            assert row[key] > 0, key
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_bench_transfer_connector_reads_each_prompt_through_the_nixl_connector(
    tmp_path: Path, tiny_qwen2: Path
) -> None:
    pytest.importorskip("nixl._api")
    out = tmp_path / "connector.json"
    argv = [
        "transfer",
        "--connector",
        str(tiny_qwen2),
        "--prompt-tokens",
        "40",
        "100",
        "--iters",
        "2",
    ]
    args = build_parser().parse_args([*argv, "--output", str(out)])
    args.func(args)
    doc = json.loads(out.read_text())
    assert doc["bench"] == "transfer_connector" and doc["kv_allocator"] == "eager"
    assert [r["prompt_tokens"] for r in doc["results"]] == [40, 40, 100, 100]
    block_bytes = 2 * 16 * 2 * 16 * 4  # tiny qwen2: K and V of 16 tokens x 2 KV heads x 16 dims, fp32
    layers = 2
    for row in doc["results"]:
        blocks = -(-row["prompt_tokens"] // 16)
        assert row["bytes"] == blocks * layers * block_bytes
        assert 0 < row["descriptors"] <= blocks * layers * 2 and row["ms"] > 0


def test_bench_transfer_connector_over_elastic_memory(tmp_path: Path, tiny_qwen2: Path) -> None:
    """--kv-allocator elastic reaches both engines: the READs are the eager run's, and the
    pages each engine mapped for them are returned once the transfers are done."""
    pytest.importorskip("nixl._api")
    out = tmp_path / "elastic.json"
    argv = ["transfer", "--connector", str(tiny_qwen2), "--prompt-tokens", "100", "--iters", "1"]
    args = build_parser().parse_args([*argv, "--kv-allocator", "elastic", "--output", str(out)])
    args.func(args)
    doc = json.loads(out.read_text())
    assert doc["kv_allocator"] == "elastic"
    (row,) = doc["results"]
    assert row["bytes"] == 7 * 2 * 2 * 16 * 2 * 16 * 4 and row["descriptors"] > 0  # 7 blocks, 2 layers
    for side in ("prefill", "decode"):
        assert doc["kv_pages"][side]["mapped"] > 0, side


def test_kv_allocator_is_for_the_connector_bench() -> None:
    args = build_parser().parse_args(["transfer", "--kv-allocator", "elastic"])
    with pytest.raises(TransferBenchError, match="--connector"):
        args.func(args)


def test_verify_catches_a_misplaced_block() -> None:
    s = Setting(size=4 * 64, block=64)
    src = touched_buffer(s.size, pattern=True)
    perms = ([2, 0, 3, 1], [0, 1, 2, 3])
    dst = src.view(4, 64)[[1, 3, 0, 2]].reshape(-1).clone()  # dst block l = src block r where perms[0][i] = l
    verify(dst, s, perms)
    with pytest.raises(TransferBenchError, match="wrong bytes"):
        verify(src, s, perms)


def test_settings_need_whole_blocks() -> None:
    args = build_parser().parse_args(["transfer", "--size-mb", "1", "--block-kb", "3"])
    with pytest.raises(TransferBenchError, match="whole number"):
        settings_of(args)
