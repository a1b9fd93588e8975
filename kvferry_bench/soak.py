"""``kvferry bench soak``: many streaming clients against ``kvferry disagg`` for a while.

Starts a deployment (``kvferry disagg``), answers each prompt of a small set alone first
(greedy: the reference), then runs ``--clients`` clients for ``--duration`` seconds, each
looping over a mix of requests:

- normal: a streamed greedy completion whose text must equal its prompt's reference;
- aborted: a stream dropped after its first chunk;
- bad: a request the edge must refuse with a 4xx (bad JSON, a missing prompt, a negative
  max_tokens).

It ends with a JSON summary: requests by kind and outcome, greedy mismatches, KV blocks
still held on every instance once the load stopped (read from each instance's /metrics,
found through the proxy's), and the deployment's resident memory (all its processes)
before and after the load, with samples during it by instance and the trend over the
load's second half, with and without the KV memory the instances committed
(soak_memory.py). A clean run has zero mismatches, zero held blocks, no unexpected
outcomes and no upward memory trend:

    kvferry bench soak smollm2 --clients 64 --duration 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shlex
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvferry.entrypoints.disagg import Child, spawn, stop_all, wait_healthy
from kvferry.ports import free_port
from kvferry_bench.soak_memory import MemorySample, memory_summary, sample_memory
from kvferry_bench.soak_probe import held_blocks, instance_urls, tree_rss

logger = logging.getLogger(__name__)

SERVED_NAME = "kvferry-soak"
WORDS = "the cat sees a small bird river stone light north quiet music number seven blue".split()
KINDS = ("normal", "aborted", "bad")
BAD_BODIES = (
    b"{not json",
    json.dumps({"model": SERVED_NAME, "max_tokens": 4}).encode(),
    json.dumps({"model": SERVED_NAME, "prompt": "hi", "max_tokens": -1}).encode(),
)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="smollm2", help="as for `kvferry serve`")
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--engine-args", default="", help="more `kvferry serve` options for every instance")
    parser.add_argument("--num-prompts", type=int, default=16, help="distinct prompts")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--mix", type=float, nargs=3, default=[0.7, 0.15, 0.15], metavar=("N", "A", "B"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-every", type=float, default=30.0, help="seconds between memory samples")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--log-dir", default=None, help="deployment logs (default: a new temporary dir)")
    parser.add_argument("--output", default="bench-results/soak.json")


@dataclass
class Tally:
    """Outcomes by kind, and the greedy answers that differed from their reference."""

    outcomes: Counter = field(default_factory=Counter)
    mismatches: list[dict] = field(default_factory=list)

    def add(self, kind: str, outcome: str) -> None:
        self.outcomes[f"{kind}:{outcome}"] += 1


def make_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) for _ in range(count)]


def body_for(prompt: str, max_tokens: int) -> dict:
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


async def stream_text(client: httpx.AsyncClient, body: dict, stop_after: int | None = None) -> str | None:
    """The streamed answer's text (None: an error event); ``stop_after`` chunks then drop it."""
    parts: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return None
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return None
            parts.extend(c.get("text") or "" for c in chunk.get("choices") or [])
            if stop_after is not None and len(parts) >= stop_after:
                break
    return "".join(parts)


async def references(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy answer, asked alone."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for prompt in prompts:
            text = await stream_text(client, body_for(prompt, max_tokens))
            if text is None:
                raise RuntimeError(f"the reference answer for {prompt!r} failed")
            out.append(text)
    return out


async def one_request(
    client: httpx.AsyncClient, kind: str, case: tuple[str, str], args, tally: Tally, rng: random.Random
) -> None:
    prompt, expected = case
    if kind == "bad":
        body = rng.choice(BAD_BODIES)
        resp = await client.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
        tally.add(kind, "refused" if 400 <= resp.status_code < 500 else f"status_{resp.status_code}")
        return
    text = await stream_text(client, body_for(prompt, args.max_tokens), 1 if kind == "aborted" else None)
    if text is None:
        tally.add(kind, "error")
    elif kind == "normal" and text != expected:
        tally.add(kind, "mismatch")
        tally.mismatches.append({"prompt": prompt, "expected": expected, "got": text})
    else:
        tally.add(kind, "ok")


async def client_loop(url: str, cases: list[tuple[str, str]], args, deadline: float, tally: Tally, seed: int):
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            kind = rng.choices(KINDS, weights=args.mix)[0]
            try:
                await one_request(client, kind, rng.choice(cases), args, tally, rng)
            except httpx.HTTPError as exc:
                tally.add(kind, type(exc).__name__)


async def soak(
    url: str, cases: list[tuple[str, str]], args, pid: int, urls: list[str]
) -> tuple[Tally, list[MemorySample]]:
    tally, samples = Tally(), []
    deadline = time.monotonic() + args.duration
    loops = [client_loop(url, cases, args, deadline, tally, args.seed + i) for i in range(args.clients)]
    await asyncio.gather(*loops, sample_memory(pid, urls, args.rss_every, deadline, samples))
    return tally, samples


def deployment(args: argparse.Namespace, port: int, log_dir: Path) -> Child:
    cmd = [sys.executable, "-m", "kvferry.entrypoints.cli", "disagg", args.model]
    cmd += ["--prefill", str(args.prefill), "--decode", str(args.decode), "--port", str(port)]
    cmd += ["--served-model-name", SERVED_NAME, "--log-dir", str(log_dir), *shlex.split(args.engine_args)]
    return Child("disagg", cmd, f"http://127.0.0.1:{port}", log_dir / "disagg.log")


def summarize(
    args,
    tally: Tally,
    held: dict[str, int],
    rss: tuple[int, int],
    samples: list[MemorySample],
    seconds: float,
) -> dict:
    unexpected = {k: v for k, v in tally.outcomes.items() if not k.endswith((":ok", ":refused"))}
    return {
        "model": args.model,
        "clients": args.clients,
        "duration_s": round(seconds, 1),
        "requests": sum(tally.outcomes.values()),
        "outcomes": dict(sorted(tally.outcomes.items())),
        "unexpected": unexpected,
        "greedy_mismatches": len(tally.mismatches),
        "mismatch_examples": tally.mismatches[:3],
        "held_blocks": held,
        "rss_start_bytes": rss[0],
        "rss_end_bytes": rss[1],
        **memory_summary(samples),
    }


def run(args: argparse.Namespace) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvferry-bench-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    child = deployment(args, free_port(), log_dir)
    spawn(child)
    try:
        wait_healthy([child], time.monotonic() + args.startup_timeout, threading.Event())
        summary = measure(args, child)
    finally:
        stop_all([child], grace=30.0)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


def measure(args: argparse.Namespace, child: Child) -> dict:
    prompts = make_prompts(args.num_prompts, args.seed)
    cases = list(zip(prompts, asyncio.run(references(child.url, prompts, args.max_tokens))))
    urls = instance_urls(child.url)
    rss_start = tree_rss(child.proc.pid)
    begin = time.monotonic()
    tally, samples = asyncio.run(soak(child.url, cases, args, child.proc.pid, urls))
    seconds = time.monotonic() - begin
    held = held_blocks(urls)
    return summarize(args, tally, held, (rss_start, tree_rss(child.proc.pid)), samples, seconds)
