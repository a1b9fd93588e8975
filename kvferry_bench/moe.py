"""kvferry bench moe: offline throughput of mixture-of-experts checkpoints, kvferry against HF
transformers on the same token ids, JSON + plot.

Each model gets the same batch of prompts (token ids): kvferry's offline `LLM.generate` and
HF's batched `generate` (left padded) each produce ``--output-len`` tokens per prompt
(greedy, EOS ignored); both are warmed up on two prompts first. The result says, per model,
tokens/s for each and on how many prompts the greedy tokens agree. Tiny checkpoints to run it on:
``python tests/fixtures/tiny_moe.py OUT_DIR qwen3_moe deepseek_v3``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from kvferry_bench.plot import pyplot
from kvferry_bench.results import host_facts, save_json
from kvferry_bench.serve import make_prompts

logger = logging.getLogger(__name__)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="+", help="MoE checkpoint directories (one entry each)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument(
        "--moe-parallel", choices=["tensor", "expert"], default=None, help="default: the engine's"
    )
    parser.add_argument(
        "--capture",
        choices=["auto", "always", "never"],
        default="never",
        help="kvferry's captured decode (default never: compiling it takes minutes on a small CPU)",
    )
    parser.add_argument("--kv-cache-memory", default="256MiB", help="KV cache per rank")
    parser.add_argument("--output", default="bench-results/moe.json")


def time_kvferry(model: str, args: argparse.Namespace, prompts: list[list[int]]) -> tuple[dict, list]:
    """kvferry's tokens/s on `prompts`, and its tokens."""
    from kvferry.engine.llm import LLM
    from kvferry.kv.budget import MemorySize
    from kvferry.sampling_params import SamplingParams

    llm = LLM(
        model,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_bytes=int(MemorySize(args.kv_cache_memory)),
        max_num_seqs=max(len(prompts), 1),
        capture=args.capture,
        **({} if args.moe_parallel is None else {"moe_parallel": args.moe_parallel}),
    )
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    finally:
        llm.engine.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return _timing(elapsed, tokens), tokens


def time_hf(model: str, args: argparse.Namespace, prompts: list[list[int]]) -> tuple[dict, list]:
    """HF transformers' tokens/s on `prompts` (batched generate), and its tokens."""
    from kvferry.model.resolve import resolve_model_config
    from kvferry_bench.hf_reference import hf_generate, load_hf_reference

    hf = load_hf_reference(resolve_model_config(model, dtype=args.dtype))
    hf_generate(hf, prompts[:2], 4)
    start = time.perf_counter()
    tokens = hf_generate(hf, prompts, args.output_len)
    elapsed = time.perf_counter() - start
    return _timing(elapsed, tokens), tokens


def _timing(elapsed: float, tokens: list[list[int]]) -> dict:
    generated = sum(len(t) for t in tokens)
    return {"seconds": elapsed, "generated_tokens": generated, "tokens_per_s": generated / elapsed}


def bench_model(model: str, args: argparse.Namespace) -> dict:
    from kvferry.model.resolve import resolve_model_config
    from kvferry.model.tokenizer import load_tokenizer

    model_config = resolve_model_config(model, dtype=args.dtype)
    prompts = make_prompts(args.num_prompts, args.input_len, load_tokenizer(model_config))
    kvferry, kvferry_tokens = time_kvferry(model, args, prompts)
    hf, hf_tokens = time_hf(model, args, prompts)
    entry = {
        "model": model_config.served_model_name,
        "architecture": model_config.architecture,
        "kvferry": kvferry,
        "hf_transformers": hf,
        "speedup": kvferry["tokens_per_s"] / hf["tokens_per_s"],
        # greedy float32 outputs agree token for token (per prompt)
        "identical_prompts": sum(a == b for a, b in zip(kvferry_tokens, hf_tokens, strict=True)),
    }
    logger.info(
        "%s: kvferry %.1f tokens/s, HF %.1f tokens/s (%.2fx)",
        entry["architecture"],
        kvferry["tokens_per_s"],
        hf["tokens_per_s"],
        entry["speedup"],
    )
    return entry


def run(args: argparse.Namespace) -> dict:
    import torch

    result = {
        "bench": "moe",
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "capture": args.capture,
        "tensor_parallel_size": args.tensor_parallel_size,
        "moe_parallel": args.moe_parallel,
        "torch": torch.__version__,
        **host_facts(),
        "models": [bench_model(model, args) for model in args.models],
    }
    plot_result(result, save_json(result, args.output))
    print(json.dumps(result, indent=2))
    return result


def plot_result(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    entries = result["models"]
    width = 0.38
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(entries), 3.5))
    for shift, key, color in ((-width / 2, "kvferry", "#2a7"), (width / 2, "hf_transformers", "#888")):
        xs = [i + shift for i in range(len(entries))]
        ax.bar(xs, [e[key]["tokens_per_s"] for e in entries], width, label=key, color=color)
    ax.set_xticks(range(len(entries)), [e["architecture"].removesuffix("ForCausalLM") for e in entries])
    ax.set_ylabel("generated tokens/s")
    ax.set_title(
        f"{result['dtype']}: {result['num_prompts']}x({result['input_len']}->{result['output_len']})"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"))
    plt.close(fig)
