"""``kvferry bench <name>``: the benchmarks' command line; ``kvferry bench`` hands its
arguments here (kvferry/entrypoints/cli.py), and nothing in the engine imports this package."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from types import ModuleType

from kvferry_bench import (
    goodput,
    hybrid,
    mla,
    moe,
    moe_split,
    pd,
    serve,
    soak,
    spec_decode,
    startup,
    throughput,
    transfer,
)
from kvferry_bench.peers import command as peers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bench:
    """One subcommand: its module defines add_args(parser) and run(args), with heavy imports
    (torch, the model, NIXL) inside run()."""

    name: str
    module: ModuleType
    help: str


BENCHES: tuple[Bench, ...] = (
    Bench("throughput", throughput, "offline: N prompts x M generated tokens"),
    Bench("serve", serve, "serving client: rate, TTFT, ITL, throughput"),
    Bench("transfer", transfer, "KV transfer GB/s over NIXL vs memcpy"),
    Bench("pd", pd, "colocated vs P/D deployments under the same serving load"),
    Bench(
        "goodput", goodput, "request-rate sweeps of serve / disagg / disagg-prefix: SLO attainment, goodput"
    ),
    Bench("hybrid", hybrid, "sliding window vs forced full attention: KV bytes, P/D, capacity"),
    Bench("mla", mla, "latent attention, absorbed vs decompressed, per phase (one layer)"),
    Bench("moe", moe, "offline throughput of MoE checkpoints, kvferry vs HF transformers"),
    Bench("moe-split", moe_split, "tensor- vs expert-parallel MoE layers on TP ranks, per forward"),
    Bench("peers", peers, "kvferry vs vLLM's CPU engine, side by side on the same cores"),
    Bench(
        "startup", startup, "time to the first answer and to /health, start-up broken down, cold vs cached"
    ),
    Bench("soak", soak, "many streaming clients against kvferry disagg: held blocks, mismatches, RSS"),
    Bench("spec-decode", spec_decode, "batch-1 decode with and without speculative decoding, same ids"),
)


def build_parser(prog: str = "kvferry bench") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="benchmarks")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    for bench in BENCHES:
        bench_parser = sub.add_parser(bench.name, help=bench.help)
        bench.module.add_args(bench_parser)
        bench_parser.set_defaults(func=bench.module.run)
    return parser


def main(argv: list[str]) -> None:
    """Run the benchmark named by argv[0] (logging is set up by the caller)."""
    args = build_parser().parse_args(argv)
    args.func(args)
