"""kvferry bench throughput: N prompts x M generated tokens (ignore_eos), tokens/s, JSON + plot.

``--json-schema`` constrains every answer to a schema (structured outputs): the difference
to a run without it is the token mask's cost. Pick a schema whose answers do not end before
``--output-len`` (e.g. an array of strings), or the rest are EOS tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

from kvferry.entrypoints.engine_args import add_engine_args, engine_config_from_args
from kvferry_bench.plot import pyplot
from kvferry_bench.results import host_facts, save_json
from kvferry_bench.serve import make_prompts

logger = logging.getLogger(__name__)


def time_kvferry(
    config,
    prompts: list[list[int]],
    output_len: int,
    temperature: float,
    top_p: float,
    json_schema: str | None = None,
) -> dict:
    from kvferry.engine.llm import LLM
    from kvferry.sampling_params import SamplingParams
    from kvferry.structured.params import StructuredOutputsParams

    llm = LLM.from_config(config)
    structured = StructuredOutputsParams(json=json_schema) if json_schema else None
    params = SamplingParams(
        max_tokens=output_len,
        temperature=temperature,
        top_p=top_p,
        ignore_eos=True,
        structured_outputs=structured,
    )
    # warm caches (and compile the grammar)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, structured_outputs=structured))
    clipped_before = [g.blocks_clipped_total for g in llm.stats().kv_groups]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    groups = [
        {
            "group": g.group,
            "kind": g.kind,
            "layers": g.num_layers,
            "blocks_clipped": g.blocks_clipped_total - before,
        }
        for g, before in zip(llm.stats().kv_groups, clipped_before, strict=True)
    ]
    return {
        "seconds": elapsed,
        "generated_tokens": generated,
        "tokens_per_s": generated / elapsed,
        "kv_groups": groups,
    }


def time_hf(config, prompts: list[list[int]], output_len: int, temperature: float, top_p: float) -> dict:
    from kvferry_bench.hf_reference import hf_generate, load_hf_reference

    model = load_hf_reference(config.model)
    hf_generate(model, prompts[:2], 4)
    start = time.perf_counter()
    outputs = hf_generate(model, prompts, output_len, temperature, top_p)
    elapsed = time.perf_counter() - start
    generated = sum(len(o) for o in outputs)
    return {"seconds": elapsed, "generated_tokens": generated, "tokens_per_s": generated / elapsed}


def add_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--hf-reference", action="store_true", help="also time HF transformers generate")
    parser.add_argument(
        "--json-schema", default=None, help="constrain answers to this JSON schema (JSON text)"
    )
    parser.add_argument("--output", default="bench-results/throughput.json")


def run(args: argparse.Namespace) -> dict:
    from kvferry.model.tokenizer import load_tokenizer

    config = engine_config_from_args(args)
    tokenizer = load_tokenizer(config.model)
    prompts = make_prompts(args.num_prompts, args.input_len, tokenizer)
    config = replace(config, scheduler=replace(config.scheduler, max_num_seqs=max(args.num_prompts, 1)))
    result = {
        "bench": "throughput",
        "model": config.model.served_model_name,
        "dtype": str(config.model.dtype).removeprefix("torch."),
        "quantization": str(config.model.quantization),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "json_schema": args.json_schema,
        **host_facts(),
        "kvferry": time_kvferry(
            config, prompts, args.output_len, args.temperature, args.top_p, args.json_schema
        ),
    }
    logger.info("kvferry: %.1f tokens/s", result["kvferry"]["tokens_per_s"])
    if args.hf_reference:
        result["hf_transformers"] = time_hf(config, prompts, args.output_len, args.temperature, args.top_p)
        logger.info("HF transformers: %.1f tokens/s", result["hf_transformers"]["tokens_per_s"])
    plot_result(result, save_json(result, args.output))
    print(json.dumps(result, indent=2))
    return result


def plot_result(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = [k for k in ("kvferry", "hf_transformers") if k in result]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(names, [result[k]["tokens_per_s"] for k in names], color=["#2a7", "#888"][: len(names)])
    ax.set_ylabel("generated tokens/s")
    ax.set_title(
        f"{result['model']} {result['dtype']}: {result['num_prompts']}x{result['output_len']} tokens"
    )
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"))
    plt.close(fig)
