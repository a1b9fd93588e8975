"""Process CPU time per decode step of SmolLM2 in bf16 on one torch thread, batch 1 and 64
(docs/benchmarks.md, "bf16 decode"). CPU time rather than wall time: on a shared machine
it moves less with the other processes' load.

Run from the repository root: `PYTHONPATH=. .venv/bin/python docs/scripts/decode_cpu_time.py`.
Prints one JSON line: batch-1 ms per step (three repetitions of 128 tokens) and batch-64 ms
per decode step (a 48-token run less a 16-token one, so the prefill cancels; two repetitions).
"""

from __future__ import annotations

import json
import time

import torch

from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams


def cpu_seconds(llm: LLM, num_prompts: int, max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(num_prompts)]
    start = time.process_time()
    llm.generate(prompts, params)
    return time.process_time() - start


def main() -> None:
    torch.set_num_threads(1)  # an in-process LLM keeps the caller's thread count
    llm = LLM("smollm2", dtype="bfloat16", kv_cache_bytes=256 << 20)
    cpu_seconds(llm, 1, 8)  # warm-up
    cpu_seconds(llm, 64, 4)
    batch1 = [cpu_seconds(llm, 1, 128) / 128 * 1e3 for _ in range(3)]
    batch64 = [(cpu_seconds(llm, 64, 48) - cpu_seconds(llm, 64, 16)) / 32 * 1e3 for _ in range(2)]
    print(json.dumps({"batch1_ms_per_step": sorted(batch1), "batch64_ms_per_decode_step": sorted(batch64)}))
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
