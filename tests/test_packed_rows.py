"""oneDNN builds one GEMM primitive per row count and caches it (memory that stays): a
weight in oneDNN's packed form pads rows to a short ladder of sizes, so a server seeing
every batch size builds few primitives. (float32 weights take kvferry's tiles where their
kernel loads, tests/test_float32_kernel.py; these tests ask for oneDNN's form.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvferry.model.layers.packed import PackedForm, pack, packed_linear, row_bucket

ROWS = range(16, 401)
PROGRAM = f"""
import torch
from kvferry.model.layers.packed import PackedForm, pack, packed_linear
weight = pack(torch.randn(64, 32), PackedForm.ONEDNN)
for rows in {ROWS!r}:
    packed_linear(torch.randn(rows, 32), weight)
"""


def test_row_buckets_are_few_and_waste_at_most_an_eighth() -> None:
    buckets = {row_bucket(rows) for rows in range(1, 2049)}
    assert len(buckets) <= 72
    assert all(rows <= row_bucket(rows) <= rows * 1.125 for rows in range(0, 4097))
    assert [row_bucket(rows) for rows in (0, 1, 15, 16, 17, 100, 1000)] == [0, 1, 15, 16, 18, 104, 1024]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not available")
def test_onednn_builds_one_primitive_per_bucket_not_per_row_count() -> None:
    """Counted by oneDNN itself (its verbose log's cache misses): 385 row counts, one
    primitive per bucket. Unpadded, each row count is a miss."""
    env = {**os.environ, "ONEDNN_VERBOSE": "all"}
    run = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, check=True)
    misses = run.stdout.count("create:cache_miss")
    buckets = len({row_bucket(rows) for rows in ROWS})
    assert 0 < misses <= buckets + 2, run.stdout[-2000:]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not available")
def test_padded_rows_compute_what_unpadded_ones_do() -> None:
    weight, bias = torch.randn(40, 24), torch.randn(40)
    packed = pack(weight, PackedForm.ONEDNN)
    for shape in ((17, 24), (3, 33, 24), (0, 24), (130, 24)):
        x = torch.randn(shape)
        out = packed_linear(x, packed, bias)
        assert out.shape == (*shape[:-1], 40)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
