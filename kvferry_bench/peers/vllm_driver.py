"""vLLM side of ``kvferry bench peers`` offline: run by the vLLM venv's python, not kvferry's.

    python vllm_driver.py WORKLOADS.json RESULT.json

Reads the model directory, dtype and workloads (prompt token ids, max_tokens, warm-up
prompts) that kvferry wrote, times each workload with ``vllm.LLM.generate`` (greedy,
ignore_eos) and writes the timings as JSON. Imports nothing of kvferry. vLLM spawns its
engine process, hence the ``__main__`` guard.
"""

from __future__ import annotations

import json
import sys
import time


def time_workload(llm, workload: dict) -> dict:
    from vllm import SamplingParams, TokensPrompt

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    warmup = [TokensPrompt(prompt_token_ids=ids) for ids in workload["warmup"]]
    if warmup:
        llm.generate(warmup, params(min(4, workload["max_tokens"])), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in workload["prompts"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params(workload["max_tokens"]), use_tqdm=False)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "num_prompts": len(prompts),
        "prompt_tokens": sum(len(ids) for ids in workload["prompts"]),
        "generated_tokens": sum(len(out.outputs[0].token_ids) for out in outputs),
        "first_tokens": [list(out.outputs[0].token_ids[:8]) for out in outputs[:2]],
    }


def main(workloads_path: str, result_path: str) -> None:
    import vllm

    spec = json.loads(open(workloads_path).read())
    start = time.perf_counter()
    llm = vllm.LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        seed=spec["seed"],
        **spec.get("vllm_kwargs", {}),
    )
    load_s = time.perf_counter() - start
    results = {}
    for workload in spec["workloads"]:
        results[workload["name"]] = time_workload(llm, workload)
        print(f"vllm {workload['name']}: {results[workload['name']]['seconds']:.3f} s", file=sys.stderr)
    doc = {"engine": "vllm", "version": vllm.__version__, "load_s": load_s, "workloads": results}
    with open(result_path, "w") as sink:
        json.dump(doc, sink, indent=2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
