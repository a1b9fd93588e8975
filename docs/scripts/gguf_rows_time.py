"""The GGUF block kernel against the packed float32 GEMM by row count: SmolLM2's four layer
linears (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) as Q4_1 tiles and as
oneDNN-packed float32 (docs/benchmarks.md, "float32 prefill attention and GGUF prefill on
the tiles").

Run from the repository root: `PYTHONPATH=. .venv/bin/python docs/scripts/gguf_rows_time.py
[--avx2]`. `--avx2` loads the kernel built with AVX2 flags (what an AVX2-only CPU runs)
instead of this machine's build. Random blocks and weights (the time does not depend on
the values). Prints one JSON line per row count: the best of 3 timed calls (after one
warm-up) summed over the four linears, in ms.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from kvferry.model.layers import cpu_kernels, gguf_kernel, packed
from kvferry.model.layers.gguf_kernel import BlockType

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (64, 256, 512, 1024, 1536, 2048)


def best_ms(call: Callable[[], torch.Tensor], repeats: int = 3) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def q4_1_blocks(out: int, inputs: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [out, inputs / 32 * 20]: fp16 d, fp16 m, 16 bytes of nibbles per block."""
    count = out * inputs // 32
    d = (torch.rand(count, 1, generator=gen) * 0.02 + 0.001).half().view(torch.uint8)
    m = (torch.randn(count, 1, generator=gen) * 0.1).half().view(torch.uint8)
    quants = torch.randint(0, 256, (count, 16), generator=gen).to(torch.uint8)
    return torch.cat([d, m, quants], dim=1).reshape(out, -1).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--avx2", action="store_true")
    args = parser.parse_args()
    if args.avx2:
        source = cpu_kernels.CSRC / "gguf_matmul.cpp"
        torch.ops.load_library(
            str(cpu_kernels.build_prebuilt(source, cpu_kernels.AVX2, Path(tempfile.mkdtemp())))
        )
    else:
        assert gguf_kernel.gguf_kernel_available()
    path = gguf_kernel.gguf_kernel_path()
    gen = torch.Generator().manual_seed(0)
    qtype = int(BlockType.Q4_1)
    weights = {
        name: (
            torch.ops.kvferry_cpu.gguf_pack(q4_1_blocks(out, inputs, gen), qtype),
            packed.pack(torch.randn(out, inputs)),
        )
        for name, (out, inputs) in SHAPES.items()
    }
    for rows in ROWS:
        tiles_ms = dense_ms = 0.0
        for name, (out, inputs) in SHAPES.items():
            tiles, dense = weights[name]
            x = torch.randn(rows, inputs, generator=gen)
            tiles_ms += best_ms(partial(torch.ops.kvferry_cpu.gguf_matmul, x, tiles, qtype, out, False))
            dense_ms += best_ms(partial(packed.onednn_linear, x, dense.tensor, None))
        print(
            json.dumps(
                {"path": path, "rows": rows, "tiles_ms": round(tiles_ms, 2), "dense_ms": round(dense_ms, 2)}
            )
        )


if __name__ == "__main__":
    main()
