"""Command line: kvferry serve | generate | proxy | disagg | build-kernels | bench (handed to kvferry_bench)."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvferry.cpu_features import MAX_ISA_ENV, torch_dispatch_caps
from kvferry.entrypoints.edge_options import add_edge_args
from kvferry.entrypoints.engine_args import DEFAULT_MODEL, add_engine_args, engine_config_from_args
from kvferry.errors import ConfigError, KVFerryError
from kvferry.process_exit import leave_remaining_objects_to_the_os

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.engine.llm import LLM

logger = logging.getLogger(__name__)


def serve_config(args: argparse.Namespace) -> EngineConfig:
    """`kvferry serve`'s engine config: its connector settled for this served instance."""
    from kvferry.connector.base import ServedInstance

    served = ServedInstance(args.host, args.kv_transfer_secret_file, args.api_key is not None)
    return engine_config_from_args(args, served)


def cmd_serve(args: argparse.Namespace) -> None:
    from kvferry.engine.core_client import CoreStart
    from kvferry.entrypoints.edge_options import limits_from_args
    from kvferry.entrypoints.openai.server import HttpOptions, run_server
    from kvferry.entrypoints.proxy_secret import for_instance

    config = serve_config(args)
    proxy_secret = for_instance(args.proxy_secret_file, config.kv_transfer.enabled, args.api_key is not None)
    limits = limits_from_args(args)
    options = HttpOptions(args.host, args.port, args.api_key, args.metrics_public, limits, proxy_secret)
    # This process has imported torch and read the model's config, and computed nothing:
    # the core forks from it with those imports done.
    run_server(config, options=options, core_start=CoreStart.FORK)


def cmd_generate(args: argparse.Namespace) -> None:
    from kvferry.engine.llm import LLM
    from kvferry.sampling_params import SamplingParams

    refuse_a_model_read_as_the_prompt(args)
    llm = LLM.from_config(engine_config_from_args(generate_capture(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sample_seed)
    out = (
        llm.chat([{"role": "user", "content": args.prompt}], params)
        if args.chat
        else llm.generate(args.prompt, params)
    )
    print(out[0].outputs[0].text, flush=True)
    if args.startup_json:
        write_startup_json(llm, args.startup_json)


def generate_capture(args: argparse.Namespace) -> argparse.Namespace:
    """`kvferry generate` runs eagerly unless --capture says otherwise: one answer is a
    batch of one for at most --max-tokens steps, where a compiled decode step saves a few
    percent of tens of milliseconds, and compiling the program costs half a minute or more
    (docs/benchmarks.md, "Start-up")."""
    if args.capture is None and not args.enforce_eager:
        logger.info(
            "kvferry generate decodes eagerly (one answer: compiling costs more than it saves; --capture auto compiles)"
        )
        args.capture = "never"
    return args


def refuse_a_model_read_as_the_prompt(args: argparse.Namespace) -> None:
    """`kvferry generate MODEL` without a prompt: the one positional is the prompt and the
    model defaults to the embedded one, which would then answer a file name. A prompt that
    names an existing file or directory, with the default model, is refused instead."""
    if args.model == DEFAULT_MODEL and Path(args.prompt).exists():
        raise ConfigError(
            f"{args.prompt!r} was read as the prompt (and the model defaulted to {DEFAULT_MODEL}): "
            f"give the model, then the prompt: kvferry generate {args.prompt} 'your prompt'"
        )


def write_startup_json(llm: LLM, path: str) -> None:
    """Where the start-up went and when the answer came, in seconds since the process began
    (kvferry bench startup reads it)."""
    report = llm.engine.startup
    doc = {
        "phases_s": report.seconds(),
        "startup_s": report.total_s,
        "first_answer_s": report.process_age_s(),
        "capture": report.decision,
    }
    Path(path).write_text(json.dumps(doc, indent=1))


# The benchmarks live in the top-level package kvferry_bench (the `bench` extra); the engine
# never imports it, and this is the one place the command line hands over to it.
BENCH_PACKAGE = "kvferry_bench"
BENCH_EXTRA_HINT = "pip install 'kvferry[bench]'"
# Everything after `kvferry bench` goes to the benchmarks' own parser, options included:
# argv strings cannot hold NUL, so no argument is read as an option here.
NO_OPTION_PREFIX = "\0"


def cmd_bench(args: argparse.Namespace) -> None:
    try:
        import kvferry_bench.cli
    except ModuleNotFoundError as exc:
        if exc.name != BENCH_PACKAGE:
            raise  # a module the benchmarks import is missing: show it as it is
        raise KVFerryError(f"the benchmarks are not installed ({BENCH_EXTRA_HINT})") from exc
    kvferry_bench.cli.main(args.bench_args)


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
    "build-kernels": (
        "kvferry.entrypoints.build_kernels",
        "compile the CPU kernels ahead of time, per ISA level",
    ),
}


def _add_pluggable(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], commands: dict[str, tuple[str, str]]
) -> None:
    for name, (module_name, help_text) in commands.items():
        module = importlib.import_module(module_name)
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

    gen = sub.add_parser(
        "generate",
        help="one answer from the shell",
        description="One answer from the shell. Decodes eagerly unless --capture is given: for one "
        "answer, compiling the decode program costs more than it saves.",
    )
    add_engine_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--raw", dest="chat", action="store_false", help="no chat template")
    gen.add_argument("--startup-json", metavar="PATH", help="write where the start-up time went (JSON)")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser(
        "bench",
        help=f"benchmarks: kvferry bench --help (the bench extra: {BENCH_EXTRA_HINT})",
        add_help=False,
        prefix_chars=NO_OPTION_PREFIX,
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    _add_pluggable(sub, PLUGGABLE_COMMANDS)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        resolve_args_api_key(args)
        capped = torch_dispatch_caps()  # before torch is imported
        if capped:
            logging.getLogger(__name__).info("held to %s: %s", os.environ.get(MAX_ISA_ENV), capped)
        args.func(args)
    except KVFerryError as exc:
        print(f"kvferry: error: {exc}", file=sys.stderr)
        sys.exit(2)


def run() -> None:
    """The `kvferry` program: main(), then an exit without the interpreter's final
    garbage collections (kvferry.process_exit)."""
    try:
        main()
    finally:
        leave_remaining_objects_to_the_os()


if __name__ == "__main__":
    run()
