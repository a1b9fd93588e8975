"""``kvferry bench startup``: how long a user waits, start after start.

Each start runs ``kvferry generate MODEL PROMPT`` in a fresh process and records the time
to its answer and where the engine's start-up went (``--startup-json``: imports and config,
executor and weights, memory profile, KV cache, warm-up and its compiling, the capture
decision); then ``kvferry serve`` is started and timed to /health and to its first answer.
Every start uses one cache directory (a new one unless --cache-dir names one), so the first
start is a cold one for kvferry's caches (capture decision, compiled programs) and the
later ones show what the caches save. The load average is recorded with every start: the
host may be shared.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvferry.entrypoints.disagg import Child, spawn, stop_all, wait_healthy
from kvferry.ports import free_port
from kvferry_bench.plot import Panel, Series, save_panels
from kvferry_bench.results import host_facts, save_json

logger = logging.getLogger(__name__)

CLI = [sys.executable, "-m", "kvferry.entrypoints.cli"]
SERVED_NAME = "startup-bench"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--starts", type=int, default=2, help="kvferry generate starts, one cache dir")
    parser.add_argument(
        "--capture",
        choices=["auto", "always", "never"],
        help="passed to every start (default: none, each command's own: generate eager, serve auto)",
    )
    parser.add_argument("--cache-dir", help="kvferry's cache directory (default: a new, empty one)")
    parser.add_argument("--no-serve", action="store_true", help="skip timing kvferry serve")
    parser.add_argument("--startup-timeout", type=float, default=1200.0)
    parser.add_argument("--output", default="results/startup.json")


def capture_args(args: argparse.Namespace) -> list[str]:
    return ["--capture", args.capture] if args.capture else []


def time_generate(args: argparse.Namespace, cache_dir: Path, index: int) -> dict:
    """One `kvferry generate` start: wall seconds to its answer and its start-up breakdown."""
    report = cache_dir.parent / f"startup-{index}.json"
    cmd = [*CLI, "generate", args.model, args.prompt, "--max-tokens", str(args.max_tokens)]
    cmd += [*capture_args(args), "--cache-dir", str(cache_dir), "--startup-json", str(report)]
    load = os.getloadavg()[0]
    begin = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - begin
    if done.returncode:
        raise RuntimeError(f"kvferry generate failed ({done.returncode}): {done.stderr[-2000:]}")
    startup = json.loads(report.read_text())
    logger.info("start %d: answer after %.1f s; %s", index, wall, startup["capture"])
    return {"start": index, "answer_s": wall, "load_avg_1m": load, "answer": done.stdout.strip(), **startup}


def time_serve(args: argparse.Namespace, cache_dir: Path) -> dict:
    """`kvferry serve`: seconds to /health and to the first completion, from the launch."""
    import httpx

    port = free_port()
    cmd = [*CLI, "serve", args.model, "--port", str(port), *capture_args(args)]
    cmd += ["--served-model-name", SERVED_NAME]
    child = Child(
        "serve",
        cmd + ["--cache-dir", str(cache_dir)],
        f"http://127.0.0.1:{port}",
        cache_dir.parent / "serve.log",
    )
    load = os.getloadavg()[0]
    begin = time.monotonic()
    spawn(child)
    try:
        wait_healthy([child], begin + args.startup_timeout, threading.Event())
        healthy = time.monotonic() - begin
        body = {"model": SERVED_NAME, "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0}
        httpx.post(f"{child.url}/v1/completions", json=body, timeout=args.startup_timeout).raise_for_status()
        answered = time.monotonic() - begin
    finally:
        stop_all([child], grace=30.0)
    logger.info("kvferry serve: /health after %.1f s, first answer after %.1f s", healthy, answered)
    return {"health_s": healthy, "first_answer_s": answered, "load_avg_1m": load}


def plot(doc: dict, path: Path) -> bool:
    starts = doc["generate"]
    xs = [float(s["start"]) for s in starts]
    phases = list(starts[0]["phases_s"])
    breakdown = Panel("kvferry generate: start-up by phase", "seconds")
    breakdown.series = [Series(name, xs, [s["phases_s"][name] for s in starts]) for name in phases]
    total = Panel("kvferry generate: time to the answer", "seconds")
    total.series = [Series("answer", xs, [s["answer_s"] for s in starts])]
    capture = f"--capture {doc['capture']}" if doc["capture"] else "default capture"
    title = f"start-up of {doc['model']} ({capture}; one cache directory)"
    return save_panels(path, [total, breakdown], "start (1 = empty cache)", title)


def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="kvferry-bench-startup-"))
    cache_dir = Path(args.cache_dir) if args.cache_dir else work / "cache"
    doc: dict = {
        "model": args.model,
        "capture": args.capture,
        "cache_dir": str(cache_dir),
        "host": host_facts(),
    }
    doc["generate"] = [time_generate(args, cache_dir, i + 1) for i in range(args.starts)]
    if not args.no_serve:
        doc["serve"] = time_serve(args, cache_dir)
    path = save_json(doc, args.output)
    plotted = plot(doc, path.with_suffix(".png"))
    logger.info("results: %s%s; logs in %s", path, " (plot beside it)" if plotted else "", work)
    return doc
