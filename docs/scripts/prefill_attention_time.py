"""Prefill attention of one span, torch's causal flash SDPA against kvferry's prefill
kernel (docs/benchmarks.md, "float32 prefill attention and GGUF prefill on the tiles").

Run from the repository root: `PYTHONPATH=. .venv/bin/python docs/scripts/prefill_attention_time.py
[--length 1500] [--avx2]`. Shape: SmolLM2's, 9 query heads over 3 KV heads of 64, float32,
the process's torch threads. `--avx2` loads the kernel built with AVX2 flags (what an
AVX2-only CPU runs) instead of this machine's build. Prints one JSON line: the lanes the
kernel ran on, the largest difference to SDPA, and the best of 5 timed calls (after 2
warm-ups) in ms for SDPA, the kernel and its portable tiles.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvferry.model.layers import attention, cpu_kernels, prefill_kernel
from kvferry.model.layers.attention import Scores

SCALE = 0.125


def best_ms(call: Callable[[], torch.Tensor], repeats: int = 5) -> float:
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=1500)
    parser.add_argument("--avx2", action="store_true")
    args = parser.parse_args()
    if args.avx2:
        library = cpu_kernels.build_prebuilt(
            prefill_kernel.SOURCE, cpu_kernels.AVX2, Path(tempfile.mkdtemp())
        )
        torch.ops.load_library(str(library))
    else:
        assert prefill_kernel.prefill_kernel_available()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(args.length, 9, 64, generator=gen)
    k, v = torch.randn(args.length, 3, 64, generator=gen), torch.randn(args.length, 3, 64, generator=gen)
    score = Scores(SCALE, 0)
    expected = attention._fresh_batch_sdpa(q, k, v, 1, score)
    got = prefill_kernel.fresh_prefill(q, k, v, 1, 0, SCALE)
    result = {
        "length": args.length,
        "threads": torch.get_num_threads(),
        "lanes": prefill_kernel.fp32_lanes(),
        "max_abs_diff": float((got - expected).abs().max()),
        "sdpa_ms": best_ms(lambda: attention._fresh_batch_sdpa(q, k, v, 1, score)),
        "kernel_ms": best_ms(lambda: prefill_kernel.fresh_prefill(q, k, v, 1, 0, SCALE)),
        "portable_ms": best_ms(lambda: prefill_kernel.fresh_prefill(q, k, v, 1, 0, SCALE, portable=True)),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
