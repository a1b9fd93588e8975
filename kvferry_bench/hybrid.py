"""``kvferry bench hybrid MODEL``: what sliding-window layers save, P/D and capacity, against
the same model forced to full attention.

MODEL is a local checkpoint directory of a hybrid model (Gemma 3, Gemma 4, Mistral or Qwen
with sliding windows). Two variants are written next to it in a scratch directory (weights
and tokenizer linked, config.json rewritten): ``hybrid``, the model as it is (or with
``--sliding-window`` tokens), and ``full``, every layer full attention (``layer_types`` all
``full_attention``, ``use_sliding_window`` off, ``sliding_window`` null). Both get
``max_position_embeddings`` raised to fit the prompt (rope has no limit; a tiny test model
states 1,024). For each variant:

- **transfer**: a prefill and a decode engine in this process over the NixlConnector (real
  NIXL agents), one ``--prompt-tokens`` prompt of fresh tokens at a time prefilled on one
  and decoded on the other, ``--iters`` times (after a warm-up round): the decoder's
  connector stats give the KV bytes read and the READ time per request
  (kvferry_bench.transfer's connector rounds). Per KV cache group, the blocks the decoder's
  next token can see of what it loads (kvferry.kv.window) times the group's page bytes (its
  layers' pages, from the decoder's KVCacheConfig), and whether they add up to the bytes read.
- **capacity**: one engine with a KV budget of ``--kv-budget-mib`` MiB, ``--requests``
  prompts of ``--prompt-tokens`` fresh tokens submitted at once (no chunked prefill: a
  prompt is admitted with all its blocks; a step may take every prompt, so memory is the
  only limit), each generating ``--max-tokens``; the most requests the scheduler ran at
  once, and its preemptions; per group, the blocks and bytes it held when the most requests
  ran (a block id costs its page in every tensor, hybrid allocation).

JSON to ``--output`` and a PNG beside it (bytes per request, transfer time, concurrent
requests per variant).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from kvferry.errors import ConfigError, KVFerryError
from kvferry.kv.spec import KVCacheConfig, SlidingWindowSpec
from kvferry.kv.usage import KVGroupStats
from kvferry.kv.window import first_visible_block
from kvferry_bench.results import host_facts, save_json

logger = logging.getLogger(__name__)

MB = 1 << 20
VARIANTS = ("hybrid", "full")


class HybridBenchError(KVFerryError):
    """A variant cannot be built or a run did not finish."""


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="local checkpoint directory of a model with sliding-window layers")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--iters", type=int, default=5, help="timed P/D transfers per variant")
    parser.add_argument(
        "--sliding-window", type=int, default=None, help="tokens; default: the checkpoint's window"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-budget-mib", type=float, default=16.0, help="KV cache of the capacity run")
    parser.add_argument("--requests", type=int, default=32, help="prompts of the capacity run")
    parser.add_argument(
        "--max-tokens", type=int, default=8, help="tokens each capacity-run request generates"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="bench-results/hybrid.json")


# ---- the two variants -----------------------------------------------------------------------


def _text_configs(config: dict) -> list[dict]:
    """The config and, for multimodal checkpoints, its text config."""
    return [config] + ([config["text_config"]] if isinstance(config.get("text_config"), dict) else [])


def has_sliding_layers(config: dict) -> bool:
    for text in _text_configs(config):
        if "use_sliding_window" in text:  # Qwen: off unless asked
            if text["use_sliding_window"]:
                return True
        elif text.get("layer_types"):  # Gemma: per layer
            if "sliding_attention" in text["layer_types"]:
                return True
        elif text.get("sliding_window"):  # Mistral: every layer
            return True
    return False


def variant_config(config: dict, variant: str, window: int | None, positions: int) -> dict:
    """`config` as the `hybrid` or the `full` variant (a new dict)."""
    config = json.loads(json.dumps(config))
    for text in _text_configs(config):
        text["max_position_embeddings"] = max(positions, text.get("max_position_embeddings") or 0)
        if variant == "hybrid":
            if window is not None:
                text["sliding_window"] = window
            continue
        if text.get("layer_types"):
            text["layer_types"] = ["full_attention"] * len(text["layer_types"])
        if "use_sliding_window" in text:
            text["use_sliding_window"] = False
        elif "layer_types" not in text:
            text["sliding_window"] = None
    return config


def write_variants(model: Path, scratch: Path, window: int | None, positions: int) -> dict[str, Path]:
    """Both variants as checkpoint directories under `scratch` (files other than config.json
    linked to the originals)."""
    config_path = model / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{model} is not a checkpoint directory (no config.json)")
    config = json.loads(config_path.read_text())
    if not has_sliding_layers(config):
        raise ConfigError(f"{model} has no sliding-window layers: nothing to compare")
    dirs = {}
    for variant in VARIANTS:
        out = scratch / variant
        out.mkdir(parents=True)
        for item in model.iterdir():
            if item.name != "config.json":
                (out / item.name).symlink_to(item.resolve())
        (out / "config.json").write_text(
            json.dumps(variant_config(config, variant, window, positions), indent=2)
        )
        dirs[variant] = out
    return dirs


# ---- engines --------------------------------------------------------------------------------


def _engine(model: Path, args: argparse.Namespace, **options):  # noqa: ANN202 - an EngineCore
    from kvferry.config import EngineOptions
    from kvferry.engine.core import EngineCore
    from kvferry.engine.options import engine_config

    positions = args.prompt_tokens + args.max_tokens + args.block_size
    opts = EngineOptions(
        str(model),
        dtype="float32",
        max_model_len=positions,
        enforce_eager=True,  # what is measured does not depend on it; starts take seconds
        block_size=args.block_size,
        seed=args.seed,
        **options,
    )
    return EngineCore(engine_config(opts))


def transfer_rows(model: Path, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """P/D rounds of one prompt at a time: the decoder's bytes read and READ time; and what
    a request reads of each KV cache group (transfer_groups)."""
    from kvferry.config import KVTransferConfig
    from kvferry_bench.transfer import connector_rows

    kv_bytes = 64 * MB  # room for a prompt in every group and a warm-up round's leftovers
    prefiller = _engine(
        model,
        args,
        kv_cache_bytes=kv_bytes,
        kv_transfer=KVTransferConfig("NixlConnector", kv_role="producer"),
    )
    try:
        decoder = _engine(
            model,
            args,
            kv_cache_bytes=kv_bytes,
            kv_transfer=KVTransferConfig("NixlConnector", kv_role="consumer"),
        )
        try:
            rounds = argparse.Namespace(prompt_tokens=[args.prompt_tokens], iters=args.iters, seed=args.seed)
            rows = connector_rows(rounds, prefiller, decoder)
            kv = decoder.scheduler.kv_cache_manager.config
            return rows, transfer_groups(kv, decoder.stats().kv_groups, args.prompt_tokens)
        finally:
            decoder.shutdown()
    finally:
        prefiller.shutdown()


def transfer_groups(kv: KVCacheConfig, groups: list[KVGroupStats], prompt_tokens: int) -> list[dict]:
    """Per KV cache group, what a decoder reads of a prefilled `prompt_tokens` prompt: of the
    N - 1 tokens it loads, the blocks its next token (position N - 1) can see, each its
    layers' pages (layers sharing another's KV own none: counted once, in their source's)."""
    loaded = prompt_tokens - 1
    rows = []
    for group, stats in zip(kv.groups, groups, strict=True):
        spec = group.spec
        first = 0
        if isinstance(spec, SlidingWindowSpec):
            first = first_visible_block(spec.sliding_window, spec.block_size, loaded)
        blocks = spec.max_blocks_needed(loaded) - first
        page_bytes = spec.page_size_bytes * len(group.layer_names)
        rows.append(_group_row(stats, blocks, page_bytes))
    return rows


def _group_row(stats: KVGroupStats, blocks: int, page_bytes: int) -> dict:
    return {
        "group": stats.group,
        "kind": stats.kind,
        "layers": stats.num_layers,
        "blocks": blocks,
        "page_bytes": page_bytes,
        "bytes": blocks * page_bytes,
    }


def capacity(model: Path, args: argparse.Namespace) -> dict:
    """`--requests` prompts at once in a fixed KV budget: the most the scheduler ran at once."""
    from kvferry.messages.engine_core import EngineCoreRequest
    from kvferry.sampling_params import SamplingParams

    engine = _engine(
        model,
        args,
        kv_cache_bytes=int(args.kv_budget_mib * MB),
        enable_chunked_prefill=False,
        max_num_batched_tokens=args.requests * args.prompt_tokens,
        max_num_seqs=args.requests,
        enable_prefix_caching=False,
    )
    try:
        rng = random.Random(args.seed)
        vocab = engine.config.model.vocab_size
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        for i in range(args.requests):
            prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
            engine.add_request(EngineCoreRequest(f"cap-{i}", prompt, params, time.time()))
        peak, at_peak, finished, start = 0, engine.stats().kv_groups, 0, time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    if out.error is not None:
                        raise HybridBenchError(f"{out.req_id} failed: {out.error}")
                    finished += 1
            now = engine.stats()
            if now.num_running > peak:  # the KV each group held when the most requests ran
                peak, at_peak = now.num_running, now.kv_groups
            if time.perf_counter() - start > 1800:
                raise HybridBenchError("the capacity run did not finish in 30 min")
        stats = engine.stats()
        kv = engine.scheduler.kv_cache_manager.config
        groups = capacity_groups(kv, at_peak, stats.kv_groups)
        return {
            "kv_budget_bytes": int(args.kv_budget_mib * MB),
            "num_blocks": stats.num_blocks,
            "groups": groups,
            "kv_bytes_at_peak": sum(g["bytes"] for g in groups),
            "requests": finished,
            "max_running": peak,
            "limited_by_requests": peak == args.requests,  # the budget may hold more
            "preemptions": stats.num_preemptions,
            "seconds": time.perf_counter() - start,
        }
    finally:
        engine.shutdown()


def capacity_groups(kv: KVCacheConfig, at_peak: list[KVGroupStats], final: list[KVGroupStats]) -> list[dict]:
    """Per group, the blocks and bytes held when the most requests ran (a block id costs its
    page in every tensor, whichever group holds it), and the blocks its window saved in all."""
    block_bytes = kv.pool_page_bytes // kv.blocks_per_page
    return [
        _group_row(held, held.blocks_in_use, block_bytes) | {"blocks_clipped_total": end.blocks_clipped_total}
        for held, end in zip(at_peak, final, strict=True)
    ]


# ---- run ------------------------------------------------------------------------------------


def summarize(rows: list[dict], groups: list[dict]) -> dict:
    ms = [r["ms"] for r in rows]
    measured = statistics.median(r["bytes"] for r in rows)
    return {
        "bytes_per_request": measured,
        "groups": groups,  # what a request reads of each KV cache group
        "groups_add_up": sum(g["bytes"] for g in groups) == measured,
        "transfer_ms_median": statistics.median(ms),
        "transfer_ms_min": min(ms),
        "descriptors": statistics.median(r["descriptors"] for r in rows),
        "rounds": rows,
    }


def run(args: argparse.Namespace) -> dict:
    model = Path(args.model)
    scratch = Path(tempfile.mkdtemp(prefix="kvferry-bench-hybrid-"))
    try:
        positions = args.prompt_tokens + args.max_tokens + 2 * args.block_size
        dirs = write_variants(model, scratch, args.sliding_window, positions)
        variants = {}
        for name, path in dirs.items():
            logger.info("%s: P/D transfers of %d-token prompts", name, args.prompt_tokens)
            transfer = summarize(*transfer_rows(path, args))
            logger.info("%s: capacity in %.1f MiB", name, args.kv_budget_mib)
            variants[name] = {"transfer": transfer, "capacity": capacity(path, args)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    hybrid, full = variants["hybrid"], variants["full"]
    doc = {
        "bench": "hybrid",
        "model": str(model),
        "sliding_window": args.sliding_window,
        "prompt_tokens": args.prompt_tokens,
        "block_size": args.block_size,
        "iters": args.iters,
        **host_facts(),
        "variants": variants,
        "ratios": {
            "bytes_full_over_hybrid": full["transfer"]["bytes_per_request"]
            / hybrid["transfer"]["bytes_per_request"],
            "running_hybrid_over_full": hybrid["capacity"]["max_running"]
            / max(1, full["capacity"]["max_running"]),
        },
    }
    plot(doc, save_json(doc, args.output).with_suffix(".png"))
    print(
        json.dumps(
            {k: v for k, v in doc.items() if k != "variants"} | {"summary": _brief(variants)}, indent=2
        )
    )
    return doc


def _brief(variants: dict) -> dict:
    return {
        name: {
            "bytes_per_request": v["transfer"]["bytes_per_request"],
            "bytes_per_request_by_group": _bytes_by_group(v["transfer"]["groups"]),
            "transfer_ms_median": round(v["transfer"]["transfer_ms_median"], 3),
            "max_running": v["capacity"]["max_running"],
            "kv_bytes_at_peak_by_group": _bytes_by_group(v["capacity"]["groups"]),
            "preemptions": v["capacity"]["preemptions"],
        }
        for name, v in variants.items()
    }


def _bytes_by_group(groups: list[dict]) -> dict[str, int]:
    return {f"{g['group']} ({g['kind']}, {g['layers']} layers)": g["bytes"] for g in groups}


def plot(doc: dict, path: Path) -> bool:
    from kvferry_bench.plot import Panel, Series, save_panels

    xs = [0.0, 1.0]
    v = doc["variants"]
    panels = [
        Panel("KV read per request", "MB", [Series("", xs, [v[n]["transfer"]["bytes_per_request"] / MB for n in VARIANTS], "o")]),
        Panel("NIXL READ time per request (median)", "ms", [Series("", xs, [v[n]["transfer"]["transfer_ms_median"] for n in VARIANTS], "o")]),
        Panel("requests running at once in the KV budget", "requests", [Series("", xs, [v[n]["capacity"]["max_running"] for n in VARIANTS], "o")]),
    ]  # fmt: skip
    title = f"{doc['prompt_tokens']}-token prompts: sliding windows vs every layer full attention"
    return save_panels(path, panels, "variant", title, xticks=(xs, list(VARIANTS)))
