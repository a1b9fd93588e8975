"""llama.cpp side of ``kvferry bench peers`` offline: run by the llama.cpp venv's python.

    python llamacpp_driver.py WORKLOADS.json RESULT.json

Loads the GGUF file named in the workloads file itself (llama.cpp runs its quantized
blocks as they are) with ``threads`` threads for decode and prompt processing, and times
each batch-1 workload (one prompt) on the token ids kvferry wrote: greedy (``temp=0``),
no stop at EOS, the KV cache emptied before every prompt so that no prefix is reused.
llama-cpp-python's ``Llama`` runs one sequence at a time, so a workload of several
prompts (``throughput``) is skipped and listed as such. Writes the timings in the other
drivers' format, plus each timed run's first-token time and all its generated tokens.
Imports nothing of kvferry.
"""

from __future__ import annotations

import json
import sys
import time

FIRST_TOKENS = 8  # as the other drivers record
BATCH = 2048  # tokens per llama_decode call (llama.cpp's own default; micro-batches of 512)


def generate(llm, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens for `prompt` from an empty cache, and the seconds to the first one."""
    llm.reset()  # n_tokens = 0: the next eval drops every cached position
    start = time.perf_counter()
    first_token_s = 0.0
    tokens: list[int] = []
    for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=False):
        if not tokens:
            first_token_s = time.perf_counter() - start
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    return tokens, first_token_s


def time_workload(llm, workload: dict) -> dict:
    """One batch-1 workload: its warm-up prompts, then its prompt timed."""
    for prompt in workload["warmup"]:
        generate(llm, prompt, min(4, workload["max_tokens"]))
    (prompt,) = workload["prompts"]
    start = time.perf_counter()
    tokens, first_token_s = generate(llm, prompt, workload["max_tokens"])
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "num_prompts": 1,
        "prompt_tokens": len(prompt),
        "generated_tokens": len(tokens),
        "first_tokens": [tokens[:FIRST_TOKENS]],
        "first_token_s": first_token_s,
        "tokens": tokens,
    }


def main(workloads_path: str, result_path: str) -> None:
    import llama_cpp

    spec = json.loads(open(workloads_path).read())
    threads = spec["threads"]
    start = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=spec["gguf_file"],
        n_ctx=spec["max_model_len"],
        n_batch=min(BATCH, spec["max_model_len"]),
        n_threads=threads,
        n_threads_batch=threads,
        seed=spec["seed"],
        verbose=False,
    )
    load_s = time.perf_counter() - start
    results, skipped = {}, {}
    for workload in spec["workloads"]:
        name = workload["name"]
        if len(workload["prompts"]) != 1:
            skipped[name] = "llama-cpp-python's Llama runs one sequence at a time"
            continue
        results[name] = time_workload(llm, workload)
        print(f"llama.cpp {name}: {results[name]['seconds']:.3f} s", file=sys.stderr)
    doc = {
        "engine": "llamacpp",
        "version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "gguf_file": spec["gguf_file"],
        "threads": threads,
        "load_s": load_s,
        "workloads": results,
        "skipped": skipped,
    }
    with open(result_path, "w") as sink:
        json.dump(doc, sink, indent=2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
