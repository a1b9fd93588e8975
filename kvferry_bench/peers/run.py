"""One ``kvferry bench peers`` invocation: install, convert, each part for each engine, report."""

from __future__ import annotations

import argparse
import logging
import subprocess
from pathlib import Path

from kvferry.entrypoints.disagg import LaunchError
from kvferry.errors import KVFerryError
from kvferry_bench.peers import command, llamacpp_install, offline, pd, report, serving
from kvferry_bench.peers.convert import gguf_path, hf_model_dir
from kvferry_bench.peers.install import ensure_nixl, ensure_vllm
from kvferry_bench.peers.llamacpp_install import ensure_llamacpp
from kvferry_bench.peers.setup import Setup, all_cores
from kvferry_bench.results import host_facts, save_json

logger = logging.getLogger(__name__)

# What one engine's failure in a part looks like; the other engine and parts still run
# (pd.PDCheckError is a RuntimeError).
ENGINE_FAILURES = (offline.DriverError, LaunchError, RuntimeError, subprocess.TimeoutExpired, OSError)


def make_setup(
    args: argparse.Namespace,
    model_dir: Path,
    vllm_venv: Path | None,
    llamacpp_venv: Path | None = None,
    gguf_file: Path | None = None,
) -> Setup:
    output = Path(args.output)
    work_dir = Path(args.work_dir) if args.work_dir else output.with_name(output.stem + "-work")
    work_dir.mkdir(parents=True, exist_ok=True)
    return Setup(
        model_dir=model_dir,
        dtype=args.dtype,
        work_dir=work_dir,
        cores=args.cpu_cores or all_cores(),
        max_model_len=command.max_model_len(command.offline_shape(args), command.serving_load(args)),
        max_num_seqs=args.max_num_seqs,
        kv_cache_gib=args.kv_cache_gib,
        seed=args.seed,
        vllm_venv=vllm_venv,
        llamacpp_venv=llamacpp_venv,
        gguf_file=gguf_file,
        kvferry_args=command.extra_args(args.kvferry_args),
        vllm_serve_args=command.extra_args(args.vllm_serve_args),
        timeout=args.timeout,
        isa_cap=args.max_isa,
    )


def offline_part(setup: Setup, engines: list[str], shape: offline.OfflineShape) -> dict:
    """Each engine's driver document (or its error) on the same workloads."""
    from kvferry.model.resolve import resolve_model_config
    from kvferry.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_config(str(setup.model_dir)))
    spec = offline.write_spec(setup, offline.make_workloads(tokenizer, shape, setup.seed))
    doc: dict = {"shape": vars(shape) | {}, "workloads_file": str(spec)}
    for engine in engines:
        try:
            doc[engine] = offline.run_offline(engine, spec, setup)
        except ENGINE_FAILURES as exc:
            logger.error("offline %s failed: %s", engine, exc)
            doc[engine] = {"error": str(exc)}
    doc["same_first_tokens"] = _same_first_tokens(doc)
    doc["llamacpp_agreement"] = report.token_agreement(doc, "llamacpp")
    return doc


def _same_first_tokens(doc: dict) -> bool | None:
    """Whether kvferry's and vLLM's first greedy tokens agree on the throughput prompts (None: one missing)."""
    runs = [doc.get(e, {}).get("workloads", {}).get("throughput") for e in ("kvferry", "vllm")]
    if not all(runs):
        return None
    return runs[0]["first_tokens"] == runs[1]["first_tokens"]


def serving_part(setup: Setup, engines: list[str], load: serving.Load) -> dict:
    """Each engine's per-rate results (or its error) under vLLM's own serving client."""
    doc: dict = {
        "load": vars(load) | {"rates": list(load.rates)},
        "client": "vllm bench serve --backend openai",
    }
    for engine in engines:
        try:
            doc[engine] = serving.bench_server(engine, setup, load)
        except ENGINE_FAILURES as exc:
            logger.error("serving %s failed: %s", engine, exc)
            doc[engine + "_error"] = str(exc)
    return doc


def pd_part(setup: Setup, engines: list[str], load: serving.Load) -> dict:
    """Each engine's P/D deployment (1 prefill + 1 decode, same cores) under vLLM's client."""
    prefill_cores, decode_cores = pd.role_cores(setup.cores)
    doc: dict = {
        "load": vars(load) | {"rates": list(load.rates)},
        "client": "vllm bench serve --backend openai",
        "cores": {"prefill": prefill_cores, "decode": decode_cores},
        "deployments": {
            "kvferry": "kvferry disagg --prefill 1 --decode 1",
            "vllm": "vllm serve x2 (NixlConnector, kv_both, kv_buffer_device cpu) behind "
            "kvferry proxy --no-early-first-token",
        },
    }
    for engine in engines:
        if engine not in command.PD_ENGINES:
            logger.info("pd: %s has no P/D; skipped", engine)
            continue
        try:
            doc[engine], doc[engine + "_check"] = pd.bench_pd(engine, setup, load)
        except ENGINE_FAILURES as exc:
            logger.error("pd %s failed: %s", engine, exc)
            doc[engine + "_error"] = str(exc)
    return doc


def run_peers(args: argparse.Namespace) -> dict:
    parts, engines = args.parts, args.engines
    if args.max_isa is not None and "vllm" in engines:
        raise KVFerryError(
            "--max-isa holds kvferry and llama.cpp; vLLM's CPU build cannot be held: leave it out"
        )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the health polls
    # vLLM's venv runs its engine, and also the serving client every engine is measured with
    needs_vllm = "vllm" in engines or "serve" in parts or "pd" in parts
    venv = ensure_vllm(Path(args.vllm_venv)).parent.parent if needs_vllm else None
    if venv is not None and "pd" in parts and "vllm" in engines:
        ensure_nixl(venv)  # vLLM's NixlConnector
    llamacpp_venv = None
    if "llamacpp" in engines and set(parts) & {"offline", "serve"}:  # it has no P/D
        venv_dir = Path(args.llamacpp_venv or llamacpp_install.default_venv(args.max_isa))
        llamacpp_venv = ensure_llamacpp(venv_dir, args.max_isa).parent.parent
    model_dir = hf_model_dir(args.model, args.dtype, Path(args.model_cache))
    setup = make_setup(args, model_dir, venv, llamacpp_venv, gguf_path(args.model))
    doc: dict = {"bench": "peers", "model": args.model, "model_dir": str(model_dir), "dtype": args.dtype}
    doc |= {"engines": engines, "parts": parts, "cores": setup.cores, "max_model_len": setup.max_model_len}
    doc |= {"max_num_seqs": setup.max_num_seqs, "kv_cache_gib": setup.kv_cache_gib}
    doc |= {**host_facts(), "work_dir": str(setup.work_dir)}
    doc["isa_cap"] = args.max_isa.value if args.max_isa else None  # the engines', not this process's
    if "offline" in parts:
        doc["offline"] = offline_part(setup, engines, command.offline_shape(args))
    if "serve" in parts:
        doc["serving"] = serving_part(setup, engines, command.serving_load(args))
    if "pd" in parts:
        doc["pd"] = pd_part(setup, engines, command.serving_load(args))
    return finish(doc, Path(args.output))


def finish(doc: dict, output: Path) -> dict:
    """Rows and ratios into `doc`; JSON, PNG and the printed table."""
    rows = []
    if "offline" in doc:
        rows += report.offline_rows(doc["offline"], doc["offline"]["shape"])
    serving_doc = doc.get("serving", {})
    rows += report.serving_rows(serving_doc)
    rows += report.pd_rows(doc.get("pd", {}))
    doc["comparison"] = [row.as_dict() for row in rows]
    path = save_json(doc, output)
    peers = " and ".join(report.ENGINE_NAMES[e] for e in doc.get("engines", ()) if e != "kvferry")
    title = f"kvferry vs {peers or 'its peers'} (CPU): {doc['model']} {doc['dtype']}, cores {doc['cores']}"
    report.save_plot(path.with_suffix(".png"), rows, serving_doc, title, doc.get("pd"))
    print(report.format_table(rows))
    if doc.get("offline", {}).get("llamacpp_agreement"):
        print(report.agreement_summary(doc["offline"]["llamacpp_agreement"], doc["dtype"]))
    if "pd" in doc:
        print(report.pd_summary(doc["pd"]))
    logger.info("results: %s (plot %s); logs in %s", path, path.with_suffix(".png"), doc["work_dir"])
    return doc
