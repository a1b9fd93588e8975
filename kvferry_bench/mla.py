"""``kvferry bench mla``: multi-head latent attention in its two forms (absorbed,
decompressed; kvferry.model.layers.mla), per phase, on one attention layer.

The measured call is the paged latent-attention operator itself: this step's rows written
to the cache, the context read back, and everything the two forms do differently (the
absorption of kv_b_proj into queries and outputs, or the expansion of the context through
it, and the attention). The projections around it (q, kv_a, o_proj) are the same in both
forms and left out. Random weights and KV, float32, block size 16.

Shapes: DeepSeek-V2-Lite's attention (16 heads, kv_lora_rank 512, rope 64, nope 128,
value 128) and, per ``--model DIR``, the shape in that checkpoint's config.json (e.g. the
tests' tiny DeepSeek-V3). Cases: decode of ``--batches`` requests at each of
``--contexts`` tokens, and prefill of one fresh chunk of each of ``--chunks`` tokens.
Each case runs ``--repeats`` timed rounds of ``--iters`` calls per form (after one
warm-up call); the JSON keeps every round's mean, the summary its median, min and max,
and which form was faster. A PNG beside the JSON plots the medians.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvferry_bench.plot import Panel, Series, save_panels
from kvferry_bench.results import host_facts, save_json

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16
FORMS = ("absorbed", "decompressed")


@dataclass(frozen=True)
class LatentShape:
    """One MLA layer's attention on one rank."""

    name: str
    heads: int
    rank: int  # kv_lora_rank
    rope: int  # qk_rope_head_dim
    nope: int  # qk_nope_head_dim
    value: int  # v_head_dim

    @classmethod
    def from_checkpoint(cls, model: Path) -> LatentShape:
        config = json.loads((model / "config.json").read_text())
        if not config.get("kv_lora_rank"):
            raise SystemExit(f"{model}: not a latent-attention model (no kv_lora_rank in config.json)")
        return cls(
            model.name,
            int(config["num_attention_heads"]),
            int(config["kv_lora_rank"]),
            int(config["qk_rope_head_dim"]),
            int(config["qk_nope_head_dim"]),
            int(config["v_head_dim"]),
        )


V2_LITE = LatentShape("deepseek-v2-lite", heads=16, rank=512, rope=64, nope=128, value=128)


@dataclass(frozen=True)
class Case:
    phase: str  # "decode" or "prefill"
    batch: int  # decodes (prefill: 1 span)
    tokens: int  # decode: context per request, the new token included; prefill: chunk length

    @property
    def label(self) -> str:
        return (
            f"{self.phase} b{self.batch} ctx{self.tokens}"
            if self.phase == "decode"
            else f"prefill {self.tokens}"
        )


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        help="checkpoint dir of a latent-attention model: its shape is measured too (repeatable)",
    )
    parser.add_argument("--no-v2-lite", action="store_true", help="skip DeepSeek-V2-Lite's shape")
    parser.add_argument("--contexts", type=int, nargs="*", default=[128, 1024, 4096], help="none: no decode")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--chunks", type=int, nargs="*", default=[512, 2048], help="none: no prefill")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per case and form")
    parser.add_argument("--iters", type=int, default=3, help="calls per round")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's; 1 is steadier on a loaded host)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="bench-results/mla.json")


def _cases(args: argparse.Namespace) -> list[Case]:
    decodes = [Case("decode", b, ctx) for b in args.batches for ctx in args.contexts]
    return decodes + [Case("prefill", 1, chunk) for chunk in args.chunks]


class _Step:
    """One case's operator inputs: a KV cache holding every request's context, random
    queries and rows, one group with one layer."""

    def __init__(self, shape: LatentShape, case: Case, gen: object) -> None:
        import torch

        from kvferry.kv.spec import latent_head_size
        from kvferry.model.forward_context import AttentionMetadata, ForwardContext, PrefillSpan

        width = shape.rank + shape.rope
        blocks = -(-case.tokens // BLOCK_SIZE)
        half = latent_head_size(width)
        self.cache = torch.randn(2, case.batch * blocks + 1, BLOCK_SIZE, 1, half, generator=gen)
        tables = torch.arange(1, case.batch * blocks + 1).view(case.batch, blocks)
        if case.phase == "decode":
            num_tokens = case.batch
            slots = tables[:, -1] * BLOCK_SIZE + (case.tokens - 1) % BLOCK_SIZE
            seq_lens = torch.full((case.batch,), case.tokens)
            attn = AttentionMetadata(slots, case.batch, tables, seq_lens, block_size=BLOCK_SIZE)
        else:
            num_tokens = case.tokens
            slots = (tables[0, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[:num_tokens]
            span = PrefillSpan(0, num_tokens, 0, tables[0])
            empty = torch.zeros(0, blocks, dtype=torch.int64)
            attn = AttentionMetadata(slots, 0, empty, torch.zeros(0, dtype=torch.int64), [span], BLOCK_SIZE)
        self.ctx = ForwardContext((attn,), {"layer": 0}, {"layer": self.cache})
        self.q_nope = torch.randn(num_tokens, shape.heads, shape.nope, generator=gen)
        self.q_rope = torch.randn(num_tokens, shape.heads, shape.rope, generator=gen)
        self.rows = torch.randn(num_tokens, width, generator=gen)
        self.kv_b = torch.randn(shape.heads * (shape.nope + shape.value), shape.rank, generator=gen) * 0.05
        self.out = torch.empty(num_tokens, shape.heads, shape.value)
        self.scale = (shape.nope + shape.rope) ** -0.5

    def call(self, form: str) -> None:
        import torch

        absorbed = form == "absorbed"
        torch.ops.kvferry.latent_attention(
            self.q_nope,
            self.q_rope,
            self.rows,
            self.kv_b,
            self.out,
            self.ctx,
            "layer",
            self.scale,
            absorbed,
            absorbed,
        )


def _rounds(step: _Step, form: str, repeats: int, iters: int) -> list[float]:
    """Milliseconds per call, one mean per round."""
    step.call(form)  # warm-up: first-touch of the gathered and expanded buffers
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            step.call(form)
        means.append((time.perf_counter() - start) / iters * 1e3)
    return means


def _measure(shape: LatentShape, case: Case, args: argparse.Namespace) -> dict:
    import torch

    import kvferry.model.layers.mla  # noqa: F401 - registers kvferry::latent_attention

    step = _Step(shape, case, torch.Generator().manual_seed(args.seed))
    step.call("absorbed")
    reference = step.out.clone()
    step.call("decompressed")
    max_diff = float((step.out - reference).abs().max())  # the two forms agree (float32)
    row: dict = {**asdict(case), "label": case.label, "max_abs_diff": max_diff}
    for form in FORMS:
        means = _rounds(step, form, args.repeats, args.iters)
        row[form] = {
            "rounds_ms": means,
            "median_ms": statistics.median(means),
            "min_ms": min(means),
            "max_ms": max(means),
        }
    row["faster"] = min(FORMS, key=lambda form: row[form]["median_ms"])
    row["decompressed_over_absorbed"] = row["decompressed"]["median_ms"] / row["absorbed"]["median_ms"]
    logger.info(
        "%s %s: absorbed %s ms, decompressed %s ms (max |diff| %.1e)",
        shape.name,
        case.label,
        _spread(row["absorbed"]),
        _spread(row["decompressed"]),
        max_diff,
    )
    return row


def run(args: argparse.Namespace) -> None:
    import os

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shapes = [] if args.no_v2_lite else [V2_LITE]
    shapes += [LatentShape.from_checkpoint(Path(model)) for model in args.model]
    if not shapes:
        raise SystemExit("nothing to measure: give --model or drop --no-v2-lite")
    results = []
    for shape in shapes:
        rows = [_measure(shape, case, args) for case in _cases(args)]
        results.append({"shape": asdict(shape), "cases": rows})
    load = os.getloadavg()
    doc = {"bench": "mla", "host": host_facts(), "load_average": list(load), "results": results}
    path = save_json(doc, args.output)
    _plot(path.with_suffix(".png"), results)
    print(json.dumps(_summary(results), indent=2))
    print(f"wrote {path}")


def _spread(timing: dict) -> str:
    """'median (min-max)' of one form's rounds, in ms."""
    return f"{timing['median_ms']:.2f} ({timing['min_ms']:.2f}-{timing['max_ms']:.2f})"


def _summary(results: list[dict]) -> dict:
    """Per shape and case: each form's median (min-max) in ms, and the faster."""
    return {
        result["shape"]["name"]: {
            row["label"]: {form: _spread(row[form]) for form in FORMS} | {"faster": row["faster"]}
            for row in result["cases"]
        }
        for result in results
    }


def _plot(path: Path, results: list[dict]) -> None:
    """Per shape: decode ms against context (a line per form and batch), prefill ms against
    chunk length (a line per form)."""
    panels = []
    for result in results:
        name = result["shape"]["name"]
        decode = Panel(f"{name}: decode", "ms per layer call", logy=True)
        prefill = Panel(f"{name}: prefill", "ms per layer call", logy=True)
        for form in FORMS:
            for batch in sorted({r["batch"] for r in result["cases"] if r["phase"] == "decode"}):
                rows = [r for r in result["cases"] if r["phase"] == "decode" and r["batch"] == batch]
                style = "-o" if batch == 1 else "--s"
                decode.series.append(_series(f"{form} b{batch}", rows, form, style))
            rows = [r for r in result["cases"] if r["phase"] == "prefill"]
            prefill.series.append(_series(form, rows, form, "-o"))
        panels += [panel for panel in (decode, prefill) if panel.series[0].xs]  # phases measured
    save_panels(
        path, panels, "tokens (decode: context; prefill: chunk)", "MLA: absorbed vs decompressed", logx=True
    )


def _series(label: str, rows: list[dict], form: str, style: str) -> Series:
    return Series(label, [r["tokens"] for r in rows], [r[form]["median_ms"] for r in rows], style)
