"""Offload benchmark: time to first token of a long prompt recomputed vs loaded from the DRAM
and disk tiers, and decode step time with the OffloadConnector on vs no connector.

    python -m kvferry_bench.offload --model smollm2 --dtype float32

Drives EngineCore steps directly so TTFT is the time until the first token comes back (not
until background saves finish). Disk loads are timed after fsync + POSIX_FADV_DONTNEED on
the tier file, so they read from the device rather than the page cache (best effort).
Writes JSON to --output (default bench-results/offload.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import sys
import tempfile
import time

from kvferry_bench.results import host_facts, save_json

logger = logging.getLogger(__name__)

GIB = 1 << 30


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=1500, help="tokens of the TTFT prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per TTFT case (median)")
    parser.add_argument("--decode-batch", type=int, default=4)
    parser.add_argument("--decode-prompt-len", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--dram-gib", type=float, default=1.0)
    parser.add_argument("--disk-gib", type=float, default=1.0)
    parser.add_argument("--disk-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--output", default="bench-results/offload.json")


def _engine_config(args, kv_transfer):
    from kvferry.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
    from kvferry.model.resolve import resolve_model_config

    max_len = max(args.prompt_len, args.decode_prompt_len) + args.decode_tokens + 16
    model = resolve_model_config(args.model, dtype=args.dtype, max_model_len=max_len)
    return EngineConfig(
        model=model,
        cache=CacheConfig(block_size=16, kv_cache_bytes=int(args.kv_cache_gib * GIB)),
        scheduler=SchedulerConfig(max_num_batched_tokens=max(2048, args.prompt_len), max_num_seqs=64),
        kv_transfer=kv_transfer or KVTransferConfig(),
    )


def _offload(extra: dict):
    from kvferry.config import KVTransferConfig

    return KVTransferConfig("OffloadConnector", kv_connector_extra_config=extra)


class Driver:
    """Runs requests on an LLM's EngineCore step by step and times them."""

    def __init__(self, llm):
        self.llm = llm
        self._ids = itertools.count()

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        from kvferry.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = []
        for prompt in prompts:
            request = self.llm.inputs.process(f"bench-{next(self._ids)}", prompt, params)
            self.llm.engine.add_request(request)
            ids.append(request.req_id)
        start, first, cached, decode_steps = time.perf_counter(), {}, {}, []
        while self.llm.engine.has_unfinished_requests():
            step_start = time.perf_counter()
            outputs = self.llm.engine.step()
            now = time.perf_counter()
            produced = [o for o in outputs if o.new_token_ids]
            if produced and len(first) == len(ids) and all(o.req_id in first for o in produced):
                decode_steps.append(now - step_start)  # every request is decoding
            for out in produced:
                if out.req_id not in first:
                    first[out.req_id], cached[out.req_id] = now - start, out.num_cached_tokens
        return {
            "ttft_s": [first[i] for i in ids],
            "cached": [cached[i] for i in ids],
            "decode_steps_s": decode_steps,
        }


def _drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _ttft_case(llm, prompt: list[int], repeats: int, before=None) -> dict:
    """Median TTFT of `prompt` over repeats, the device prefix cache reset before each run."""
    driver, times, cached = Driver(llm), [], []
    for _ in range(repeats):
        assert llm.engine.scheduler.reset_prefix_cache()
        if before is not None:
            before()
        result = driver.run([prompt], max_tokens=1)
        times.append(result["ttft_s"][0])
        cached.append(result["cached"][0])
    return {"ttft_s_median": statistics.median(times), "ttft_s": times, "num_cached_tokens": cached}


def _decode_case(llm, prompts: list[list[int]], num_tokens: int) -> dict:
    steps = Driver(llm).run(prompts, max_tokens=num_tokens)["decode_steps_s"]
    return {
        "step_s_median": statistics.median(steps),
        "step_s_mean": statistics.fmean(steps),
        "steps": len(steps),
    }


def _offload_totals(llm) -> dict:
    return dict(llm.engine.connector.scheduler.totals)


def bench_ttft(args, prompt: list[int], disk_dir: str) -> dict:
    from kvferry.engine.llm import LLM

    results = {}
    llm = LLM.from_config(_engine_config(args, None))
    Driver(llm).run([prompt[: args.decode_prompt_len]], 2)  # warm the kernels up
    results["recompute"] = _ttft_case(llm, prompt, args.repeats)
    del llm
    llm = LLM.from_config(_engine_config(args, _offload({"dram_gib": args.dram_gib})))
    Driver(llm).run([prompt], 1)  # computes and saves it (waits for the saves)
    results["dram"] = _ttft_case(llm, prompt, args.repeats)
    results["dram"]["offload_stats"] = stats = _offload_totals(llm)
    results["dram"]["load_s_per_run"] = stats.get("offload_load_seconds", 0.0) / args.repeats
    del llm
    extra = {"dram_gib": 0, "disk_dir": disk_dir, "disk_gib": args.disk_gib}
    llm = LLM.from_config(_engine_config(args, _offload(extra)))
    Driver(llm).run([prompt], 1)
    disk_file = llm.engine.executor.worker.runner.connector.worker.disk.path
    results["disk"] = _ttft_case(llm, prompt, args.repeats, before=lambda: _drop_page_cache(disk_file))
    results["disk"]["offload_stats"] = stats = _offload_totals(llm)
    results["disk"]["load_s_per_run"] = stats.get("offload_load_seconds", 0.0) / args.repeats
    llm.engine.shutdown()
    return results


def bench_decode(args, prompts: list[list[int]]) -> dict:
    from kvferry.engine.llm import LLM

    results = {}
    for name, transfer in (("no_connector", None), ("offload", _offload({"dram_gib": args.dram_gib}))):
        llm = LLM.from_config(_engine_config(args, transfer))
        Driver(llm).run([prompts[0][:64]], 4)  # warm-up
        results[name] = _decode_case(llm, prompts, args.decode_tokens)
        if transfer is not None:
            results[name]["offload_stats"] = _offload_totals(llm)
            llm.engine.shutdown()
        del llm
    return results


def run(args: argparse.Namespace) -> dict:

    from kvferry.model.resolve import resolve_model_config
    from kvferry.model.tokenizer import load_tokenizer
    from kvferry_bench.serve import make_prompts

    tokenizer = load_tokenizer(resolve_model_config(args.model, dtype=args.dtype))
    prompt = make_prompts(1, args.prompt_len, tokenizer, seed=1)[0]
    decode_prompts = make_prompts(args.decode_batch, args.decode_prompt_len, tokenizer, seed=2)
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-offload-", dir=args.disk_dir) as disk_dir:
        ttft = bench_ttft(args, prompt, disk_dir)
    result = {
        "bench": "offload",
        "command": " ".join(["python -m kvferry_bench.offload", *sys.argv[1:]]),
        "model": args.model,
        "dtype": args.dtype,
        "prompt_len": len(prompt),
        **host_facts(),
        "cpus": os.cpu_count(),
        "ttft": ttft,
        "decode": bench_decode(args, decode_prompts),
        "decode_batch": args.decode_batch,
        "decode_prompt_len": args.decode_prompt_len,
    }
    save_json(result, args.output)
    print(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m kvferry_bench.offload", description=__doc__)
    add_args(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
