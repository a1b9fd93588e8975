"""kvferry bench spec-decode: batch-1 decode with and without speculative decoding, on
the same token ids, in turns (plain, drafted, plain, drafted ...), JSON + plot.

Three workloads, as the answer's relation to its context decides what prompt lookup gains:

- ``looping``: the 32 token ids 1000..1031 (the ids of the batch-1 comparisons with
  llama.cpp in docs/benchmarks.md; SmolLM2's greedy answer to them falls into a loop;
  modulo the vocabulary for a smaller one);
- ``story``: a chat request for a short story (an answer that repeats little);
- ``code-edit``: a chat request to rename a variable in a short function (an answer that
  quotes its prompt).

Per workload and engine: ms per generated token, from a 1-token run and a
(``--decode-len`` + 1)-token run (ignore_eos) on the same prompt, so the prompt's step
cancels out; min, median and max over ``--repeats``. The drafted engine's answers are
checked against the plain engine's (greedy: they must be equal token for token), and the
draft tokens it verified and kept are counted.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import replace
from typing import Any

from kvferry.entrypoints.engine_args import add_engine_args, engine_config_from_args
from kvferry_bench.plot import pyplot
from kvferry_bench.results import host_facts, save_json

logger = logging.getLogger(__name__)

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'
CHAT_WORKLOADS = {
    "story": "Write a short story about a robot who learns to paint.",
    "code-edit": (
        "Rename the variable x to count in this code:\n"
        "def f(x):\n    x = x + 1\n    print(x)\n    return x * 2\n"
    ),
}
LOOPING_IDS = list(range(1000, 1032))


def add_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.set_defaults(speculative_config=DEFAULT_SPEC)
    parser.add_argument("--decode-len", type=int, default=128, help="generated tokens timed per run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per workload and engine")
    parser.add_argument("--output", default="bench-results/spec_decode.json")


def workloads(tokenizer: Any, vocab_size: int) -> dict[str, list[int]]:
    """The workloads' prompt token ids (chat-templated where the tokenizer has a template)."""
    prompts = {"looping": [i % vocab_size for i in LOOPING_IDS]}
    for name, text in CHAT_WORKLOADS.items():
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        prompts[name] = tokenizer.encode(text, add_special_tokens=False)
    return prompts


def _timed_run(llm: Any, prompt: list[int], decode_len: int) -> tuple[float, list[int]]:
    """ms per token of one prompt's decode, and its answer."""
    from kvferry.sampling_params import SamplingParams

    inputs = {"prompt_token_ids": prompt}
    start = time.perf_counter()
    llm.generate(inputs, SamplingParams(max_tokens=1, temperature=0.0))
    first = time.perf_counter()
    (out,) = llm.generate(inputs, SamplingParams(max_tokens=decode_len + 1, temperature=0.0, ignore_eos=True))
    end = time.perf_counter()
    return ((end - first) - (first - start)) / decode_len * 1e3, list(out.outputs[0].token_ids)


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run(args: argparse.Namespace) -> dict:
    from kvferry.engine.llm import LLM
    from kvferry.model.tokenizer import load_tokenizer
    from kvferry.sampling_params import SamplingParams
    from kvferry.spec_decode.config import SpeculativeConfig

    config = engine_config_from_args(args)
    if not config.speculative.enabled:
        raise SystemExit("kvferry bench spec-decode: --speculative-config must name a method")
    vocab = config.model.vocab_size
    prompts = workloads(load_tokenizer(config.model), vocab)
    engines = {"plain": LLM.from_config(replace(config, speculative=SpeculativeConfig())), "drafted": None}
    engines["drafted"] = LLM.from_config(config)
    for llm in engines.values():  # the warm-up compiles what a first step compiles
        llm.generate(
            {"prompt_token_ids": [i % vocab for i in range(2000, 2032)]},
            SamplingParams(max_tokens=8, temperature=0),
        )
    result: dict[str, Any] = {
        "bench": "spec-decode",
        "model": config.model.served_model_name,
        "dtype": str(config.model.dtype).removeprefix("torch."),
        "quantization": str(config.model.quantization),
        "capture": str(config.compilation.capture),
        "speculative_config": json.loads(args.speculative_config),
        "decode_len": args.decode_len,
        "repeats": args.repeats,
        **host_facts(),
        "workloads": {name: _measure(engines, prompt, args) for name, prompt in prompts.items()},
    }
    for name, row in result["workloads"].items():
        logger.info(
            "%s: %.2f -> %.2f ms/token (medians), %d of %d drafts kept, answers equal: %s",
            name,
            row["plain"]["median"],
            row["drafted"]["median"],
            row["drafts_kept"],
            row["drafts_verified"],
            row["answers_equal"],
        )
    plot_result(result, save_json(result, args.output))
    print(json.dumps(result, indent=2))
    return result


def _measure(engines: dict[str, Any], prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in engines}
    answers: dict[str, list[int]] = {}
    drafted = engines["drafted"]
    before = drafted.stats()
    for _ in range(args.repeats):
        for name, llm in engines.items():  # in turns: a host's slow moment hits both
            ms, answers[name] = _timed_run(llm, prompt, args.decode_len)
            times[name].append(ms)
    after = drafted.stats()
    return {
        "prompt_tokens": len(prompt),
        **{name: _spread(values) for name, values in times.items()},
        "speedup_median": statistics.median(times["plain"]) / statistics.median(times["drafted"]),
        "drafts_verified": after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
        "drafts_kept": after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
        "answers_equal": answers["plain"] == answers["drafted"],
    }


def plot_result(result: dict, path: Any) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(result["workloads"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for i, (engine, color) in enumerate((("plain", "#888"), ("drafted", "#2a7"))):
        values = [result["workloads"][n][engine]["median"] for n in names]
        ax.bar([x + (i - 0.5) * width for x in range(len(names))], values, width, label=engine, color=color)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ms per token (median)")
    ax.set_title(f"{result['model']} {result['quantization']} batch-1 decode, speculative decoding")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"))
    plt.close(fig)
