"""``kvferry bench pd``: colocated against disaggregated serving, same model, same load.

Starts one deployment at a time on localhost, runs the serving benchmark (``kvferry bench
serve``: Poisson arrivals at each request rate, streamed completions, TTFT / ITL /
end-to-end / throughput) against it, stops it, and starts the next:

- ``colocated``: one ``kvferry serve`` that may use every core;
- ``pd``: ``kvferry disagg`` (``--prefill`` + ``--decode`` instances behind the proxy, KV
  pulled over NIXL; on a CPU each instance pinned to its own share of the cores);
- ``pd-layerwise``: the same with layer-wise prefillers (``"layerwise": true``): the proxy
  sends both legs at once and the decoder reads each layer as the prefill computes.

With ``--link RATE[,DELAY]`` every instance runs on an emulated host of its own whose link
is shaped (pd_link.py: network namespaces, ``tc``; needs root), one prefill and one decode
instance:

    kvferry bench pd smollm2 --link 1gbit,100us --input-len 4000 --output-len 16 \
        --request-rate 0.1 --max-concurrency 1 --deployments colocated pd pd-layerwise

All runs land in one JSON file (one labelled run per deployment) and its PNG:

    kvferry bench pd smollm2 --input-len 1000 --output-len 64 --request-rate 0.05 0.1 0.2
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvferry.entrypoints.disagg import Child, spawn, stop_all, wait_healthy
from kvferry.ports import free_port
from kvferry_bench import pd_link, serve
from kvferry_bench.pd_link import Link

logger = logging.getLogger(__name__)

DEPLOYMENTS = ("colocated", "pd", "pd-layerwise")
SERVED_NAME = "kvferry-bench"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="smollm2", help="as for `kvferry serve`")
    parser.add_argument("--deployments", nargs="+", default=["colocated", "pd"], choices=DEPLOYMENTS)
    parser.add_argument(
        "--link",
        type=Link.parse,
        default=None,
        help="RATE[,DELAY]: each instance on its own emulated host, its link shaped (tc units: 1gbit,100us)",
    )
    parser.add_argument("--prefill", type=int, default=1, help="pd: prefill instances")
    parser.add_argument("--decode", type=int, default=1, help="pd: decode instances")
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--engine-args", default="", help="more `kvferry serve` options for every instance")
    parser.add_argument("--request-rate", nargs="+", type=serve.parse_rate, default=[0.05, 0.1, 0.2])
    parser.add_argument("--num-prompts", type=int, default=16, help="per request rate")
    parser.add_argument("--input-len", type=int, default=1000, help="prompt tokens (exact)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--json-schema", default=None, help="answers constrained to this JSON schema")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--log-dir", default=None, help="deployment logs (default: a new temporary dir)")
    parser.add_argument("--output", default="bench-results/pd.json")


def deployment_command(args: argparse.Namespace, name: str, port: int) -> list[str]:
    cli = [sys.executable, "-m", "kvferry.entrypoints.cli"]  # 3 items: see serve_args
    common = ["--port", str(port), "--served-model-name", SERVED_NAME, *shlex.split(args.engine_args)]
    if name == "colocated":
        return cli + ["serve", args.model, *common]
    sizes = ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    sizes += ["--prefill-tp", str(args.prefill_tp), "--decode-tp", str(args.decode_tp)]
    layerwise = ["--kv-connector-extra-config", '{"layerwise": true}'] if name == "pd-layerwise" else []
    return cli + ["disagg", args.model, *sizes, *layerwise, *common]


def serve_args(args: argparse.Namespace, label: str, url: str, command: list[str]) -> argparse.Namespace:
    """`kvferry bench serve`'s arguments for one deployment (its parser supplies the rest)."""
    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    argv = ["--url", url, "--model", SERVED_NAME, "--tokenizer", args.model, "--label", label]
    argv += ["--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len)]
    argv += ["--output-len", str(args.output_len), "--seed", str(args.seed), "--output", args.output]
    argv += ["--request-rate", *(str(rate) for rate in args.request_rate)]
    if args.max_concurrency:
        argv += ["--max-concurrency", str(args.max_concurrency)]
    if args.json_schema:
        argv += ["--json-schema", args.json_schema]
    parsed = parser.parse_args(argv)
    parsed.deployment = shlex.join(["kvferry", *command[3:]])  # as a user would type it
    return parsed


def bench_deployment(args: argparse.Namespace, name: str, log_dir: Path) -> dict:
    """Start deployment `name`, benchmark it, stop it; the merged results document."""
    port = free_port()
    command = deployment_command(args, name, port)
    child = Child(name, command, f"http://127.0.0.1:{port}", log_dir / f"{name}.log")
    spawn(child)
    try:
        begin = time.monotonic()
        wait_healthy([child], begin + args.startup_timeout, threading.Event())
        logger.info("%s ready in %.0f s; benchmarking", name, time.monotonic() - begin)
        return serve.run(serve_args(args, name, child.url, command))
    finally:
        stop_all([child], grace=30.0)


def run(args: argparse.Namespace) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvferry-bench-pd-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    doc: dict = {}
    if args.link is not None:
        pd_link.check_can_run()
    for name in args.deployments:
        if args.link is not None:
            doc = pd_link.bench_deployment(args, name, log_dir, serve_args)
        else:
            doc = bench_deployment(args, name, log_dir)
    logger.info(
        "results: %s (plot %s); logs in %s", args.output, Path(args.output).with_suffix(".png"), log_dir
    )
    return doc
