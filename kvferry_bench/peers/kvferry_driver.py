"""kvferry side of ``kvferry bench peers`` offline: the same workloads file as the vLLM driver.

    python -m kvferry_bench.peers.kvferry_driver WORKLOADS.json RESULT.json [kvferry engine args]

Builds ``LLM.from_config`` from kvferry's own engine arguments (the model the setup gives
kvferry: the directory, or the GGUF itself under --quantization gguf; dtype,
max_model_len and max_num_seqs of the workloads file, then any extra ones), times each
workload (greedy, ignore_eos) and writes the timings in the vLLM driver's format.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path


def engine_config(spec: dict, extra: list[str]):
    from kvferry.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser(prog="kvferry-driver")
    add_engine_args(parser)
    argv = [spec["kvferry_model"], "--dtype", spec["dtype"], "--max-model-len", str(spec["max_model_len"])]
    argv += ["--max-num-seqs", str(spec["max_num_seqs"]), "--seed", str(spec["seed"]), *extra]
    return engine_config_from_args(parser.parse_args(argv))


def time_workload(llm, workload: dict) -> dict:
    from kvferry.sampling_params import SamplingParams

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    if workload["warmup"]:
        llm.generate(workload["warmup"], params(min(4, workload["max_tokens"])))
    start = time.perf_counter()
    outputs = llm.generate(workload["prompts"], params(workload["max_tokens"]))
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "num_prompts": len(workload["prompts"]),
        "prompt_tokens": sum(len(ids) for ids in workload["prompts"]),
        "generated_tokens": sum(len(out.outputs[0].token_ids) for out in outputs),
        "first_tokens": [list(out.outputs[0].token_ids[:8]) for out in outputs[:2]],
        "tokens": list(outputs[0].outputs[0].token_ids),  # the first prompt's, for agreement checks
    }


def run_workloads(spec: dict, extra: list[str]) -> dict:
    """Load kvferry once, time every workload of `spec`; the result document."""
    from importlib.metadata import version

    from kvferry.engine.llm import LLM

    start = time.perf_counter()
    llm = LLM.from_config(engine_config(spec, extra))
    load_s = time.perf_counter() - start
    results = {}
    for workload in spec["workloads"]:
        results[workload["name"]] = time_workload(llm, workload)
        print(f"kvferry {workload['name']}: {results[workload['name']]['seconds']:.3f} s", file=sys.stderr)
    return {"engine": "kvferry", "version": version("kvferry"), "load_s": load_s, "workloads": results}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(run_workloads(spec, argv[2:]), indent=2))


if __name__ == "__main__":
    main()
