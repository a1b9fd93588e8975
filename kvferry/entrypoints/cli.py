"""Command line: kvferry serve | generate | bench."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import TYPE_CHECKING

from kvferry.entrypoints.edge_options import add_edge_args
from kvferry.entrypoints.engine_args import add_engine_args, engine_config_from_args
from kvferry.errors import KVFerryError

if TYPE_CHECKING:
    from kvferry.config import EngineConfig


def serve_config(args: argparse.Namespace) -> EngineConfig:
    """`kvferry serve`'s engine config: its connector settled for this served instance."""
    from kvferry.connector.base import ServedInstance

    served = ServedInstance(args.host, args.kv_transfer_secret_file, args.api_key is not None)
    return engine_config_from_args(args, served)


def cmd_serve(args: argparse.Namespace) -> None:
    from kvferry.entrypoints.edge_options import limits_from_args
    from kvferry.entrypoints.openai.server import HttpOptions, run_server
    from kvferry.entrypoints.proxy_secret import for_instance

    config = serve_config(args)
    proxy_secret = for_instance(args.proxy_secret_file, config.kv_transfer.enabled, args.api_key is not None)
    limits = limits_from_args(args)
    options = HttpOptions(args.host, args.port, args.api_key, args.metrics_public, limits, proxy_secret)
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
    "hybrid": ("kvferry.bench.hybrid", "sliding window vs forced full attention: KV bytes, P/D, capacity"),
    "peers": ("kvferry.bench.peers.command", "kvferry vs vLLM's CPU engine, side by side on the same cores"),
    "soak": (
        "kvferry.bench.soak",
        "many streaming clients against kvferry disagg: held blocks, mismatches, RSS",
    ),
}


def _add_pluggable(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], commands: dict[str, tuple[str, str]]
) -> None:
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
        help="file holding the KV connector's shared secret (or set $KVFERRY_KV_SECRET)",
    )
    serve.add_argument(
        "--proxy-secret-file",
        default=None,
        help="file holding the proxy's credential, which kv_transfer_params and KV releases need "
        "(or set $KVFERRY_PROXY_SECRET)",
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
