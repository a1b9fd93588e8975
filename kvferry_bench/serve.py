"""``kvferry bench serve``: an online serving benchmark against an OpenAI-compatible URL.

For each request rate, ``--num-prompts`` streamed completions arrive as a Poisson process
(``inf``: all at once); each asks for exactly ``--output-len`` tokens (ignore_eos) of a
random-word prompt of ``--input-len`` tokens (cut with the model's tokenizer when
``--tokenizer`` is given, else about one token per word). Measured per request: time to
first token (TTFT), inter-token latency (gaps between streamed chunks, ITL), time per
output token after the first (TPOT) and end-to-end latency; per rate: request and output
token throughput. Results go to a JSON file holding one run per ``--label`` (a run with the
same label is replaced, others kept), and a PNG of the metrics vs rate, one line per label:

    kvferry bench serve --url http://127.0.0.1:8000 --model smollm2 --label colocated
    kvferry bench serve --url http://127.0.0.1:8001 --model smollm2 --label pd
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvferry_bench.results import save_json

logger = logging.getLogger(__name__)

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which "
    "river stone light house garden winter music paper window market island letter bridge forest"
).split()


def parse_rate(raw: str) -> float:
    rate = float(raw)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be positive or inf, not {raw!r}")
    return rate


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server or proxy base URL")
    parser.add_argument("--model", required=True, help="model name sent in requests")
    parser.add_argument(
        "--request-rate",
        nargs="+",
        type=parse_rate,
        default=[1.0, 4.0, math.inf],
        help="requests/s, one run each; 'inf': all at once",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--tokenizer", default=None, help="model dir/id whose tokenizer cuts prompts exactly")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--label", default="default", help="name of this run in the JSON and the plot")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json-schema",
        default=None,
        help="every request's answer constrained to this JSON schema (structured_outputs.json)",
    )
    parser.add_argument("--output", default="bench-results/serve.json")


@dataclass
class RequestResult:
    ok: bool
    start: float
    ttft: float = 0.0
    e2el: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


# ---- prompts ----------------------------------------------------------------------------


def make_prompts(num: int, input_len: int, tokenizer=None, seed: int = 0) -> list[str | list[int]]:
    """Random-word prompts: token ids cut to ``input_len`` with a tokenizer, else that many words."""
    rng = random.Random(seed)
    prompts: list[str | list[int]] = []
    for _ in range(num):
        words = [rng.choice(WORDS) for _ in range(input_len * (2 if tokenizer is not None else 1))]
        text = " ".join(words)
        if tokenizer is not None:
            prompts.append(tokenizer.encode(text, add_special_tokens=False)[:input_len])
        else:
            prompts.append(text)
    return prompts


def load_tokenizer(model: str):
    from kvferry.model.resolve import resolve_model_config
    from kvferry.model.tokenizer import load_tokenizer as load

    return load(resolve_model_config(model))


# ---- one request ------------------------------------------------------------------------


async def send_one(client, url: str, body: dict, headers: dict) -> RequestResult:
    """One streamed completion, timed chunk by chunk."""
    start = time.perf_counter()
    result = RequestResult(ok=False, start=start)
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                last = _on_chunk(result, json.loads(line[5:]), start, last)
                if result.error:
                    return result
    except Exception as exc:  # a failed request is counted, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2el = time.perf_counter() - start
    result.ok = last is not None
    if not result.output_tokens:  # no usage chunk: count the streamed chunks
        result.output_tokens = len(result.itls) + int(result.ok)
    if not result.ok:
        result.error = "no tokens streamed"
    return result


def _on_chunk(result: RequestResult, chunk: dict, start: float, last: float | None) -> float | None:
    if "error" in chunk:
        result.error = str(chunk["error"].get("message", chunk["error"]))
        return last
    if chunk.get("usage"):
        result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
        result.output_tokens = chunk["usage"].get("completion_tokens", 0)
    if not any(c.get("text") for c in chunk.get("choices") or []):
        return last
    now = time.perf_counter()
    if last is None:
        result.ttft = now - start
    else:
        result.itls.append(now - last)
    return now


# ---- one rate ---------------------------------------------------------------------------


async def run_rate(args: argparse.Namespace, prompts: list, rate: float) -> tuple[list[RequestResult], float]:
    """All prompts at ``rate`` (Poisson arrivals); the results and the wall time."""
    import httpx

    url = args.url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=args.max_concurrency or len(prompts)
    )

    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as client:

        async def one(prompt) -> RequestResult:
            async with limit:
                return await send_one(client, url, _body(args, prompt), headers)

        # warm-up: a prompt of its own, so no measured prompt is in a prefix cache
        await send_one(client, url, _body(args, "warm up", max_tokens=2), headers)
        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            if i and math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.ensure_future(one(prompt)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _body(args: argparse.Namespace, prompt, max_tokens: int | None = None) -> dict:
    body = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": max_tokens or args.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.json_schema:
        body["structured_outputs"] = {"json": json.loads(args.json_schema)}
    return body


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:  # nearest-rank percentile
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return {"mean": 1000 * statistics.fmean(values), "p50": 1000 * pick(0.5), "p99": 1000 * pick(0.99)}


def summarize(results: list[RequestResult], duration: float, rate: float) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})[:5]
    return {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "ttft_ms": _stats_ms([r.ttft for r in done]),
        "itl_ms": _stats_ms([gap for r in done for gap in r.itls]),
        # the second token: in P/D the decoder's first, after the KV it read (a whole-request
        # transfer shows here, not in the TTFT: the proxy streams the prefiller's token)
        "second_token_ms": _stats_ms([r.ttft + r.itls[0] for r in done if r.itls]),
        # the gap between a request's first and second tokens: in P/D the hand-off (the
        # transfer, then the decoder's first step); per request, so steadier than the
        # difference of the two percentiles above
        "first_itl_ms": _stats_ms([r.itls[0] for r in done if r.itls]),
        "tpot_ms": _stats_ms(tpots),
        "e2el_ms": _stats_ms([r.e2el for r in done]),
    }


# ---- results ----------------------------------------------------------------------------


def merge_run(path: Path, run: dict) -> dict:
    """The JSON document at ``path`` with ``run`` added (replacing a run of the same label)."""
    doc = {"bench": "serve", "runs": []}
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = None
        if isinstance(old, dict) and old.get("bench") == "serve" and isinstance(old.get("runs"), list):
            doc = old
        else:
            logger.warning("%s is not a serve benchmark result: overwriting it", path)
    doc["runs"] = [r for r in doc["runs"] if r.get("label") != run["label"]] + [run]
    return doc


def _x(rate: float | str, inf_at: float) -> float:
    return inf_at if rate == "inf" else float(rate)


def plot(doc: dict, path: Path) -> bool:
    from kvferry_bench.plot import Panel, Series, save_panels

    rates = {r["request_rate"] for run in doc["runs"] for r in run["results"]}
    inf_at = 2 * max([float(r) for r in rates if r != "inf"] or [0.5])  # 'inf' right of the rest
    ticks = sorted({_x(r, inf_at) for r in rates})
    labels = ["inf" if "inf" in rates and t == inf_at else f"{t:g}" for t in ticks]
    panels = [
        Panel("time to first token", "ms"),
        Panel("inter-token latency", "ms"),
        Panel("end-to-end latency", "ms"),
        Panel("output throughput", "tokens/s"),
    ]
    for run in doc["runs"]:
        xs = [_x(r["request_rate"], inf_at) for r in run["results"]]
        for panel, key in zip(panels[:3], ("ttft_ms", "itl_ms", "e2el_ms")):
            panel.series.append(Series(f"{run['label']} p50", xs, [r[key]["p50"] for r in run["results"]]))
            panel.series.append(
                Series(f"{run['label']} p99", xs, [r[key]["p99"] for r in run["results"]], "--x")
            )
        panels[3].series.append(Series(run["label"], xs, [r["output_throughput"] for r in run["results"]]))
    first = doc["runs"][-1]
    title = f"{first['model']}: {first['num_prompts']} requests, {first['input_len']} in / {first['output_len']} out"
    return save_panels(path, panels, "request rate (req/s)", title, xticks=(ticks, labels), logx=True)


def run(args: argparse.Namespace) -> dict:
    rates = args.request_rate
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    results = []
    for index, rate in enumerate(rates):
        # new prompts per rate: a server's prefix cache must not serve one rate's from another's
        prompts = make_prompts(args.num_prompts, args.input_len, tokenizer, args.seed + index)
        reqs, duration = asyncio.run(run_rate(args, prompts, rate))
        summary = summarize(reqs, duration, rate)
        results.append(summary)
        logger.info(
            "rate %s: %d ok, %d failed, %.2f req/s, %.1f tok/s, TTFT p50 %.0f ms, 2nd token p50 %.0f ms "
            "(first ITL p50 %.0f ms), ITL p50 %.1f ms",
            summary["request_rate"],
            summary["completed"],
            summary["failed"],
            summary["request_throughput"],
            summary["output_throughput"],
            summary["ttft_ms"]["p50"],
            summary["second_token_ms"]["p50"],
            summary["first_itl_ms"]["p50"],
            summary["itl_ms"]["p50"],
        )
    run_doc = {
        "label": args.label,
        "url": args.url,
        "model": args.model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "exact_input_len": tokenizer is not None,
        "max_concurrency": args.max_concurrency,
        "json_schema": args.json_schema,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "deployment": getattr(args, "deployment", None),  # the command that served it, if known
        "results": results,
    }
    path = Path(args.output)
    doc = merge_run(path, run_doc)
    save_json(doc, path)
    plot(doc, path.with_suffix(".png"))
    print(json.dumps(run_doc, indent=2))
    return doc
