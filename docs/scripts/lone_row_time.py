"""The step that computes a prompt's last token alone over its cached context: what a P/D
decoder runs once the prefiller's KV has landed, and what an engine runs after a prefix-cache
hit of every block before that token (docs/benchmarks.md, "The decoder's first step").

Run from the repository root, pinned to one core as a P/D decoder is:
`PYTHONPATH=. taskset -c 1 .venv/bin/python docs/scripts/lone_row_time.py [--prompt-len N]
[--repeats R]`. SmolLM2 (the embedded GGUF, float32), eager. One request computes the whole
prompt; each timed request then sends the same prompt with max_tokens 1, so every block
before the last token is a prefix-cache hit (a prompt of whole blocks plus one token: the
last token is computed alone). A second figure times a request of 9 tokens on the same
cache: its 8 decode steps over the first step give a decode step's time. Prints one JSON
line: medians and minimums in ms.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvferry import LLM, SamplingParams


def _timed(llm: LLM, ids: list[int], params: SamplingParams, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], params)
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--prompt-len", type=int, default=4001, help="tokens (4001: 250 blocks of 16 and one)"
    )
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    llm = LLM("smollm2", enforce_eager=True, max_model_len=args.prompt_len + 64)
    rng = random.Random(0)
    ids = [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([{"prompt_token_ids": ids}], one)  # computes the prompt; its blocks stay cached
    lone = _timed(llm, ids, one, args.repeats)
    nine = _timed(
        llm, ids, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True), max(3, args.repeats // 4)
    )
    decode_step = (statistics.median(nine) - statistics.median(lone)) / 8
    print(
        json.dumps(
            {
                "prompt_len": args.prompt_len,
                "lone_row_ms": {"median": round(statistics.median(lone), 1), "min": round(min(lone), 1)},
                "decode_step_ms": round(decode_step, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
