"""Does an engine's memory grow with the requests it serves, or with the shapes it has seen?
(docs/benchmarks.md, "Soak", the memory paragraph.)

Run from the repository root:
`PYTHONPATH=. .venv/bin/python docs/scripts/shape_memory.py {varied,fixed} [ROUNDS]`
(prefix `ONEDNN_PRIMITIVE_CACHE_CAPACITY=0` to leave oneDNN's primitive cache out).

An in-process `LLM("smollm2")` (float32, eager, one torch thread) serves ROUNDS rounds (40)
of random-token prompts: `varied` 1-23 prompts of 4-79 tokens per round, `fixed` 8 prompts
of 32. After each round glibc gives back what it can (`malloc_trim(0)`) and the script
records the process's RSS, glibc's bytes in use (`mallinfo2`: blocks handed out, mmapped
ones included) and the number of Python objects. Prints one JSON line.
"""

from __future__ import annotations

import ctypes
import gc
import json
import random
import sys

import torch

from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks")
        + ("fordblks", "keepcost")
    ]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2


def rss_mib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def malloc_in_use_mib() -> int:
    info = LIBC.mallinfo2()
    return (info.uordblks + info.hblkhd) >> 20


def round_prompts(rng: random.Random, varied: bool) -> list[list[int]]:
    count = rng.randrange(1, 24) if varied else 8
    return [
        [rng.randrange(100, 20000) for _ in range(rng.randrange(4, 80) if varied else 32)]
        for _ in range(count)
    ]


def main() -> None:
    varied = sys.argv[1] == "varied"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    torch.set_num_threads(1)
    llm = LLM("smollm2", kv_cache_bytes=256 << 20, enforce_eager=True)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    samples = []
    for _ in range(rounds):
        llm.generate(round_prompts(rng, varied), params)
        gc.collect()
        LIBC.malloc_trim(0)
        samples.append(
            {"rss_mib": rss_mib(), "malloc_mib": malloc_in_use_mib(), "objects": len(gc.get_objects())}
        )
    print(json.dumps({"shapes": sys.argv[1], "rounds": rounds, "samples": samples}))
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
