"""How long a long prompt stalls a decoding request, with and without a prefill budget
(docs/benchmarks.md, "Prefill budget"): process CPU time per engine step of SmolLM2 in bf16
on one torch thread. CPU time rather than wall time: on a shared machine it moves less with
the other processes' load.

Run from the repository root:
`PYTHONPATH=. .venv/bin/python docs/scripts/prefill_stall_cpu_time.py [BUDGET ...]`
(default: 256 and 2048, the step's whole token budget, i.e. no cap). For each budget one
request decodes; at its sixth step a 1,000-token prompt (fresh token ids, no prefix hit)
arrives. Prints one JSON line per budget: a decode-only step's ms, the ms of each step until
the prompt's prefill ends, their longest (the decoding request's worst inter-token gap)
and their sum (the prompt's time to its first token, less queueing).
"""

from __future__ import annotations

import json
import random
import sys
import time

import torch

from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams

PROMPT_LEN = 1000
ARRIVES_AT_STEP = 5


def step_ms(llm: LLM, arriving: list[int]) -> tuple[list[float], list[float]]:
    """CPU ms of each step before the prompt arrives, and of each step until its prefill ends."""
    before = [_timed_step(llm)[0] for _ in range(ARRIVES_AT_STEP)]
    _add(llm, "long", arriving, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    during: list[float] = []
    prefilled = False
    while not prefilled:
        elapsed, finished = _timed_step(llm)
        during.append(elapsed)
        prefilled = "long" in finished
    return before, during


def _timed_step(llm: LLM) -> tuple[float, set[str]]:
    """One engine step's CPU ms and the requests it finished."""
    start = time.process_time()
    processed = llm.outputs.process_outputs(llm.engine.step())
    elapsed = 1e3 * (time.process_time() - start)
    return elapsed, {out.request_id for out in processed.request_outputs if out.finished}


def _add(llm: LLM, req_id: str, token_ids: list[int], params: SamplingParams) -> None:
    request = llm.inputs.process(req_id, token_ids, params)
    llm.outputs.add_request(req_id, None, request.prompt_token_ids, params)
    llm.engine.add_request(request)


def measure(budget: int) -> dict:
    llm = LLM("smollm2", dtype="bfloat16", prefill_budget_with_decodes=budget, kv_cache_bytes=256 << 20)
    rng = random.Random(budget)
    decode = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm.generate([[rng.randrange(100, 20000) for _ in range(32)]], decode)  # warm-up
    _add(llm, "decoding", [rng.randrange(100, 20000) for _ in range(32)], decode)
    before, during = step_ms(llm, [rng.randrange(100, 20000) for _ in range(PROMPT_LEN)])
    llm.engine.shutdown()
    return {
        "budget": budget,
        "decode_step_ms": round(min(before)),
        "prompt_steps_ms": [round(ms) for ms in during],
        "worst_gap_ms": round(max(during)),
        "prompt_total_ms": round(sum(during)),
    }


def main() -> None:
    torch.set_num_threads(1)  # an in-process LLM keeps the caller's thread count
    budgets = [int(arg) for arg in sys.argv[1:]] or [256, 2048]
    for budget in budgets:
        print(json.dumps(measure(budget)))


if __name__ == "__main__":
    main()
