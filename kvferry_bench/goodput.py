"""``kvferry bench goodput``: request-rate sweeps against several deployments, on the same
token ids, with SLO attainment and goodput.

Each deployment in ``--deployments`` is started on localhost, swept, and stopped:

- ``serve``: one colocated ``kvferry serve``;
- ``disagg``: ``kvferry disagg`` (round-robin proxy, every request disaggregated);
- ``disagg-prefix``: ``kvferry disagg --policy prefix --local-prefill-tokens N``;
- ``vllm``: vLLM's own server, colocated, the reference (``goodput_vllm``).

For each request rate the workload's requests (``goodput_workload``: random long prompts,
shared-prefix multi-turn traffic, or multi-turn conversations that share nothing but their
own earlier turns) arrive as a Poisson process, streamed, ``--output-len``
tokens each (ignore_eos). Prompts differ between rates (new seed per rate) unless
``--same-prompts``. Per rate: TTFT / TPOT / ITL percentiles, the fraction of requests
meeting both ``--slo-ttft-ms`` and ``--slo-tpot-ms``, each instance's prefix-cache hit rate
(its /metrics, before and after the rate), the hit rate of the pool that computes prompts
(prefillers, or the lone server) next to an oracle's on the same trace, instance count and
cache size (``goodput_oracle``), and the proxy's legs by path
(``kvferry_proxy:prefill_path_total``). Per deployment: the goodput, the highest rate
with at least ``--attainment`` (0.9) of requests meeting both. One JSON file and a PNG:

    kvferry bench goodput smollm2 --workload shared-prefix --request-rate 0.1 0.2 \\
        --deployments serve,disagg,disagg-prefix --slo-ttft-ms 2000 --slo-tpot-ms 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvferry.entrypoints.disagg import Child, spawn, stop_all, wait_healthy
from kvferry.ports import free_port
from kvferry_bench import goodput_vllm, serve
from kvferry_bench.goodput_metrics import (
    PrefixCacheCounts,
    RequestTiming,
    Slo,
    attainment,
    counts_delta,
    goodput,
    num_blocks,
    percentiles_ms,
    pooled_hit_rate,
    prefill_paths,
    prefix_cache_counts,
)
from kvferry_bench.goodput_oracle import oracle_hit_rate
from kvferry_bench.goodput_vllm import VLLM
from kvferry_bench.goodput_workload import (
    WorkloadKind,
    WorkloadRequest,
    WorkloadSpec,
    make_workload,
    poisson_gaps,
)
from kvferry_bench.results import host_facts, save_json

logger = logging.getLogger(__name__)

DEPLOYMENTS = ("serve", "disagg", "disagg-prefix", VLLM)
DEFAULT_DEPLOYMENTS = ("serve", "disagg", "disagg-prefix")
LONE_SERVERS = ("serve", VLLM)  # no proxy in front: the server computes every prompt
SERVED_NAME = "kvferry-bench"


def parse_deployments(raw: str) -> list[str]:
    names = [name.strip() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in DEPLOYMENTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"deployments must be among {','.join(DEPLOYMENTS)}, not {raw!r}")
    return names


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="smollm2", help="as for `kvferry serve`")
    parser.add_argument("--deployments", type=parse_deployments, default=list(DEFAULT_DEPLOYMENTS))
    parser.add_argument("--prefill", type=int, default=1, help="disagg: prefill instances")
    parser.add_argument("--decode", type=int, default=1, help="disagg: decode instances")
    parser.add_argument("--local-prefill-tokens", type=int, default=64, help="disagg-prefix: as for disagg")
    parser.add_argument("--idle-decoder-prefills", action="store_true", help="disagg-prefix: as for disagg")
    parser.add_argument("--local-on-prefillers", action="store_true", help="disagg-prefix: as for disagg")
    parser.add_argument("--engine-args", default="", help="more `kvferry serve` options for every instance")
    parser.add_argument("--workload", choices=[k.value for k in WorkloadKind], default="shared-prefix")
    parser.add_argument("--request-rate", nargs="+", type=serve.parse_rate, default=[0.1, 0.2, 0.4])
    parser.add_argument("--num-prompts", type=int, default=16, help="requests per rate (at most)")
    parser.add_argument("--input-len", type=int, default=1000, help="random: prompt tokens")
    parser.add_argument(
        "--num-system",
        type=int,
        default=2,
        help="shared-prefix: system prompts (multi-turn: x --users conversations)",
    )
    parser.add_argument("--users", type=int, default=4, help="shared-prefix: users per system prompt")
    parser.add_argument(
        "--system-len",
        type=int,
        default=512,
        help="shared-prefix: system prompt tokens (multi-turn: first message)",
    )
    parser.add_argument("--turn-len", type=int, default=64, help="shared-prefix: tokens added per turn")
    parser.add_argument("--turns", type=int, default=2, help="shared-prefix: turns per conversation")
    parser.add_argument(
        "--block-size", type=int, default=16, help="the instances' KV block size (the oracle's hit rate)"
    )
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument("--attainment", type=float, default=0.9, help="goodput: fraction meeting both")
    parser.add_argument("--same-prompts", action="store_true", help="every rate gets the same prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--log-dir", default=None, help="deployment logs (default: a new temporary dir)")
    parser.add_argument("--output", default="bench-results/goodput.json")
    goodput_vllm.add_args(parser)


def workload_spec(args: argparse.Namespace, vocab_size: int) -> WorkloadSpec:
    return WorkloadSpec(
        kind=WorkloadKind(args.workload),
        num_requests=args.num_prompts,
        input_len=args.input_len,
        num_system=args.num_system,
        users_per_system=args.users,
        system_len=args.system_len,
        turn_len=args.turn_len,
        turns=args.turns,
        vocab_size=vocab_size,
    )


def deployment_command(args: argparse.Namespace, name: str, port: int) -> list[str]:
    """A kvferry deployment's command (`vllm`'s is goodput_vllm.command)."""
    cli = [sys.executable, "-m", "kvferry.entrypoints.cli"]
    common = ["--port", str(port), "--served-model-name", SERVED_NAME, *shlex.split(args.engine_args)]
    if name == "serve":
        return [*cli, "serve", args.model, *common]
    sizes = ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    sizes += ["--startup-timeout", str(args.startup_timeout)]  # disagg's own wait for its instances
    routing = ["--policy", "prefix", "--local-prefill-tokens", str(args.local_prefill_tokens)]
    routing += ["--idle-decoder-prefills"] if args.idle_decoder_prefills else []
    routing += ["--local-on-prefillers"] if args.local_on_prefillers else []
    return [*cli, "disagg", args.model, *sizes, *(routing if name == "disagg-prefix" else []), *common]


# ---- measuring one rate -----------------------------------------------------------------


async def _get_text(client, url: str) -> str:  # noqa: ANN001 - an httpx.AsyncClient
    resp = await client.get(url)
    resp.raise_for_status()
    return str(resp.text)


async def instance_urls(client, url: str, name: str) -> dict[str, str]:  # noqa: ANN001
    """Label -> base URL of every engine instance behind ``url`` (the proxy's /health)."""
    if name in LONE_SERVERS:
        return {name: url}
    health = json.loads(await _get_text(client, url + "/health"))
    return {
        f"{role}-{i}": inst["url"]
        for role, insts in health["instances"].items()
        for i, inst in enumerate(insts)
    }


async def pool_capacity(client, instances: dict[str, str], pool: str) -> int:  # noqa: ANN001
    """The smallest KV cache (blocks) among the instances whose label starts with ``pool``."""
    sizes = [
        num_blocks(await _get_text(client, u + "/metrics"))
        for label, u in instances.items()
        if label.startswith(pool)
    ]
    return min(sizes)


def routed_pool(name: str) -> str:
    """The label prefix of the instances that compute prompts: prefillers, or the lone server."""
    return name if name in LONE_SERVERS else "prefill"


def hit_rates(
    args: argparse.Namespace, name: str, requests: list[WorkloadRequest], deltas: dict, capacity: int
) -> dict:
    """The routed pool's measured hit rate (tokens pooled) next to the oracle's on the same
    trace, cache size and number of instances."""
    pool = routed_pool(name)
    size = sum(label.startswith(pool) for label in deltas)
    known = capacity > 0  # a server that does not say its cache size gets no oracle
    oracle = oracle_hit_rate([r.prompt for r in requests], size, capacity, args.block_size) if known else None
    return {
        "prefix_cache_hit_rate": {label: counts.hit_rate for label, counts in deltas.items()},
        "pool_hit_rate": pooled_hit_rate(deltas, pool),
        "oracle_hit_rate": oracle.hit_rate if oracle is not None else None,
        "pool_capacity_blocks": capacity,
    }


async def _scrape(
    client, url: str, instances: dict[str, str], proxied: bool
) -> tuple[dict[str, PrefixCacheCounts], dict]:  # noqa: ANN001
    caches = {
        label: prefix_cache_counts(await _get_text(client, u + "/metrics")) for label, u in instances.items()
    }
    paths = prefill_paths(await _get_text(client, url + "/metrics")) if proxied else {}
    return caches, paths


def _body(args: argparse.Namespace, prompt: list[int], max_tokens: int) -> dict:
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _timing(result: serve.RequestResult) -> RequestTiming:
    tokens = result.output_tokens
    tpot = (result.e2el - result.ttft) / (tokens - 1) if result.ok and tokens > 1 else 0.0
    return RequestTiming(result.ok, result.ttft, tpot, tuple(result.itls))


async def run_rate(
    args: argparse.Namespace, url: str, name: str, requests: list[WorkloadRequest], rate: float, seed: int
) -> dict:
    """Send ``requests`` at ``rate``; the rate's summary with counters read around it."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)) as client:
        instances = await instance_urls(client, url, name)
        completions = url + "/v1/completions"
        capacity = await pool_capacity(client, instances, routed_pool(name))
        proxied = name not in LONE_SERVERS
        caches_before, paths_before = await _scrape(client, url, instances, proxied)
        start = time.perf_counter()
        tasks = []
        for gap, request in zip(poisson_gaps(len(requests), rate, seed), requests):
            await asyncio.sleep(gap)
            body = _body(args, list(request.prompt), args.output_len)
            tasks.append(asyncio.ensure_future(serve.send_one(client, completions, body, {})))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        caches_after, paths_after = await _scrape(client, url, instances, proxied)
    timings = [_timing(r) for r in results]
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    deltas = {label: caches_after[label].minus(caches_before[label]) for label in instances}
    return {
        "request_rate": rate if rate != float("inf") else "inf",
        "completed": sum(r.ok for r in results),
        "failed": sum(not r.ok for r in results),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "ttft_ms": percentiles_ms([t.ttft for t in timings if t.ok]),
        "tpot_ms": percentiles_ms([t.tpot for t in timings if t.ok]),
        "itl_ms": percentiles_ms([gap for t in timings if t.ok for gap in t.itls]),
        "slo_attainment": attainment(timings, slo),
        # each request's (ok, TTFT ms, TPOT ms), in arrival order: attainment under other objectives
        "requests": [[t.ok, round(1000 * t.ttft, 1), round(1000 * t.tpot, 1)] for t in timings],
        **hit_rates(args, name, requests, deltas, capacity),
        "prefill_paths": counts_delta(paths_after, paths_before),
    }


# ---- deployments, results ---------------------------------------------------------------


def prompts_for_rates(args: argparse.Namespace, spec: WorkloadSpec) -> list[list[WorkloadRequest]]:
    """One workload per rate (new seeds, so no rate is served from another's cache), or the
    same for every rate with --same-prompts."""
    seeds = [args.seed if args.same_prompts else args.seed + 1000 * i for i in range(len(args.request_rate))]
    return [make_workload(spec, seed) for seed in seeds]


def bench_deployment(args: argparse.Namespace, name: str, workloads: list, log_dir: Path) -> dict:
    port = free_port()
    command, env = (
        goodput_vllm.command(args, SERVED_NAME, port)
        if name == VLLM
        else (deployment_command(args, name, port), {})
    )
    child = Child(name, command, f"http://127.0.0.1:{port}", log_dir / f"{name}.log", env)
    spawn(child)
    try:
        begin = time.monotonic()
        wait_healthy([child], begin + args.startup_timeout, threading.Event())
        logger.info("%s ready in %.0f s; benchmarking", name, time.monotonic() - begin)
        results = []
        for index, (rate, requests) in enumerate(zip(args.request_rate, workloads)):
            summary = asyncio.run(run_rate(args, child.url, name, requests, rate, args.seed + index))
            logger.info(
                "%s rate %s: attainment %.2f, TTFT p90 %.0f ms, TPOT p90 %.0f ms, hits %s "
                "(pool %s, oracle %s), paths %s",
                name,
                summary["request_rate"],
                summary["slo_attainment"],
                summary["ttft_ms"]["p90"],
                summary["tpot_ms"]["p90"],
                summary["prefix_cache_hit_rate"],
                summary["pool_hit_rate"],
                summary["oracle_hit_rate"],
                summary["prefill_paths"],
            )
            results.append(summary)
    finally:
        stop_all([child], grace=30.0)
    attained = [(float(rate), r["slo_attainment"]) for rate, r in zip(args.request_rate, results)]
    return {
        "label": name,
        "deployment": shlex.join(command if name == VLLM else ["kvferry", *command[3:]]),
        "goodput": goodput(attained, args.attainment),
        "results": results,
    }


def plot(doc: dict, path: Path) -> bool:
    from kvferry_bench.plot import Panel, Series, save_panels

    panels = [
        Panel("TTFT p90", "ms"),
        Panel("TPOT p90", "ms"),
        Panel("SLO attainment", "fraction"),
        Panel("prefix-cache hit rate (mean of instances)", "fraction"),
    ]
    for run in doc["runs"]:
        finite = [r for r in run["results"] if r["request_rate"] != "inf"]
        xs = [float(r["request_rate"]) for r in finite]
        panels[0].series.append(Series(run["label"], xs, [r["ttft_ms"]["p90"] for r in finite]))
        panels[1].series.append(Series(run["label"], xs, [r["tpot_ms"]["p90"] for r in finite]))
        panels[2].series.append(Series(run["label"], xs, [r["slo_attainment"] for r in finite]))
        panels[3].series.append(Series(run["label"], xs, [_mean_hit_rate(r) for r in finite]))
    title = f"{doc['model']}: {doc['workload']['kind']}, SLO TTFT {doc['slo']['ttft_ms']:g} ms / TPOT {doc['slo']['tpot_ms']:g} ms"
    return save_panels(path, panels, "request rate (req/s)", title)


def _mean_hit_rate(result: dict) -> float:
    rates = [rate for rate in result["prefix_cache_hit_rate"].values() if rate is not None]
    return sum(rates) / len(rates) if rates else 0.0


def run(args: argparse.Namespace) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvferry-bench-goodput-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = serve.load_tokenizer(args.model)
    spec = workload_spec(args, len(tokenizer))
    workloads = prompts_for_rates(args, spec)
    doc = {
        "bench": "goodput",
        "model": args.model,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": host_facts(),
        "workload": {**spec.__dict__, "kind": spec.kind.value, "same_prompts": args.same_prompts},
        "output_len": args.output_len,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "attainment": args.attainment},
        "runs": [bench_deployment(args, name, workloads, log_dir) for name in args.deployments],
    }
    path = save_json(doc, args.output)
    plot(doc, path.with_suffix(".png"))
    for entry in doc["runs"]:
        logger.info("%s: goodput %s req/s", entry["label"], entry["goodput"])
    logger.info("results: %s (plot %s); logs in %s", path, path.with_suffix(".png"), log_dir)
    return doc
