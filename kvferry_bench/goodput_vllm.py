"""The ``vllm`` deployment of ``kvferry bench goodput``: vLLM's own OpenAI server,
colocated on the cores this bench may use, as the reference beside kvferry's deployments.

vLLM runs from its own venv (``kvferry_bench.peers.install``: installed on first use,
never a kvferry dependency) on the model as an HF directory (a GGUF such as the embedded
SmolLM2 converted once, ``kvferry_bench.peers.convert``), float32, with its KV cache size in
``VLLM_CPU_KVCACHE_SPACE`` and its OpenMP threads bound to this process's cores. The
same token ids reach it as reach kvferry (``/v1/completions`` with ``prompt`` as ids,
``ignore_eos``, streamed); its ``/metrics`` has the prefix-cache counters kvferry's have
(``vllm:prefix_cache_queries_total``, ``..._hits_total``).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from kvferry_bench.peers.convert import hf_model_dir
from kvferry_bench.peers.install import DEFAULT_VENV, ensure_vllm, vllm_env
from kvferry_bench.peers.setup import all_cores

VLLM = "vllm"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vllm-venv", type=Path, default=DEFAULT_VENV, help="vllm: its venv (made on first use)"
    )
    parser.add_argument(
        "--vllm-args",
        default="--max-model-len 2048",
        help="vllm: more `vllm serve` options (dtype float32 and the served name are set)",
    )
    parser.add_argument("--vllm-kv-cache-gib", type=float, default=1.0, help="vllm: VLLM_CPU_KVCACHE_SPACE")


def command(args: argparse.Namespace, served_name: str, port: int) -> tuple[list[str], dict[str, str]]:
    """`vllm serve` of the bench's model, and the environment variables it needs."""
    vllm = ensure_vllm(args.vllm_venv).with_name("vllm")  # beside the venv's python
    model = hf_model_dir(args.model, "float32")
    serve = [str(vllm), "serve", str(model.absolute()), "--port", str(port)]
    serve += ["--served-model-name", served_name, "--dtype", "float32", "--seed", str(args.seed)]
    env = {"VLLM_CPU_KVCACHE_SPACE": f"{args.vllm_kv_cache_gib:g}", "VLLM_CPU_OMP_THREADS_BIND": all_cores()}
    whole = vllm_env(env)
    own = {key: value for key, value in whole.items() if key in env or key.startswith(("VLLM_", "DO_NOT"))}
    return [*serve, *shlex.split(args.vllm_args)], own
