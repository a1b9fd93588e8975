"""``kvferry bench peers``: kvferry against vLLM's CPU engine and llama.cpp, side by side, same cores.

One engine at a time, pinned to the same cores, on the same model directory (the embedded
``smollm2`` converted once to an HF directory in the requested dtype):

- ``offline``: N prompts x M tokens throughput, batch-1 decode, one long prefill, on the same
  token ids (kvferry's ``LLM`` and ``vllm.LLM``, each in a driver process of its own);
- ``serve``: vLLM's own client (``vllm bench serve``, random dataset, ignore_eos) at each
  request rate against ``vllm serve``, then against ``kvferry serve``;
- ``pd``: the same client, load and rates against vLLM's own P/D (a prefill and a decode
  ``vllm serve`` with its NixlConnector, behind ``kvferry proxy``), then against ``kvferry
  disagg`` (1 prefill + 1 decode); each engine's instances pinned as disagg pins its own
  (prefill on the first half of the cores, decode on the second). A probe first checks that
  vLLM's decoder really receives the prompt's KV (see pd.py).

vLLM's CPU build is installed on first use into a venv of its own (``--vllm-venv``), and
nixl into it on the first ``pd`` run; llama-cpp-python (built from source by pip) into
another (``--llamacpp-venv``) on llama.cpp's first use. One JSON file (``--output``) with a PNG beside it;
the table printed at the end puts both engines' figures side by side with kvferry / vLLM
ratios:

    kvferry bench peers --parts offline,serve --request-rate 0.05 0.1 0.2 --num-prompts 16
    kvferry bench peers --parts pd --request-rate 0.15 0.3 --num-prompts 6
"""

from __future__ import annotations

import argparse
import logging
import shlex

from kvferry.cpu_features import IsaCap
from kvferry_bench import serve as bench_serve
from kvferry_bench.peers import llamacpp_install
from kvferry_bench.peers.convert import DEFAULT_CACHE
from kvferry_bench.peers.install import DEFAULT_VENV
from kvferry_bench.peers.offline import OfflineShape
from kvferry_bench.peers.serving import Load

logger = logging.getLogger(__name__)

PARTS = ("offline", "serve", "pd")
ENGINES = ("kvferry", "vllm", "llamacpp")
PD_ENGINES = ("kvferry", "vllm")  # llama.cpp has no P/D


def comma_list(choices: tuple[str, ...]):
    """An argparse type: 'a,b' -> ['a', 'b'], each one of `choices`."""

    def parse(raw: str) -> list[str]:
        items = [item.strip() for item in raw.split(",") if item.strip()]
        bad = [item for item in items if item not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"choose from {', '.join(choices)} (comma-separated), not {raw!r}"
            )
        return list(dict.fromkeys(items))

    return parse


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default="smollm2", help="as for `kvferry serve` (GGUF: converted)"
    )
    parser.add_argument(
        "--parts",
        type=comma_list(PARTS),
        default=["offline", "serve"],
        help="offline,serve,pd (pd: vLLM's P/D behind kvferry proxy vs kvferry disagg, "
        "the serve options' load)",
    )
    parser.add_argument(
        "--engines",
        type=comma_list(ENGINES),
        default=list(ENGINES),
        help="kvferry,vllm,llamacpp (llama.cpp: the GGUF itself, batch-1 decode and prefill; no P/D)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--vllm-venv", default=str(DEFAULT_VENV), help="vLLM's own venv (installed on first use)"
    )
    parser.add_argument(
        "--llamacpp-venv",
        default=None,
        help="llama.cpp's own venv (llama-cpp-python, built from source on first use; default "
        f"{llamacpp_install.DEFAULT_VENV}, or {llamacpp_install.DEFAULT_VENV}-LEVEL with --max-isa)",
    )
    parser.add_argument(
        "--max-isa",
        type=IsaCap,
        choices=list(IsaCap),
        metavar="{" + ",".join(cap.value for cap in IsaCap) + "}",
        default=None,
        help="hold kvferry ($KVFERRY_MAX_ISA, with torch's and oneDNN's dispatch) and llama.cpp "
        "(built for the level, in a venv of its own) to this instruction-set level: on an "
        "AVX-512 host, avx2 runs the code paths of an AVX2-only CPU; vLLM cannot be held",
    )
    parser.add_argument("--model-cache", default=str(DEFAULT_CACHE), help="where converted models are kept")
    _add_offline_args(parser)
    _add_serving_args(parser)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="both engines, both parts")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache of each engine (GiB)")
    parser.add_argument(
        "--cpu-cores", default=None, help="cores both engines run on, e.g. '0-1' (default: all)"
    )
    parser.add_argument(
        "--kvferry-args", default="", help="more kvferry engine options, e.g. --kvferry-args=--enforce-eager"
    )
    parser.add_argument(
        "--vllm-serve-args",
        default="",
        help="more `vllm serve` options, e.g. --vllm-serve-args='--enforce-eager'",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per driver or client run")
    parser.add_argument("--work-dir", default=None, help="workloads, logs (default: next to --output)")
    parser.add_argument("--output", default="bench-results/peers.json")


def _add_offline_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("offline")
    group.add_argument("--offline-prompts", type=int, default=64)
    group.add_argument("--offline-input-len", type=int, default=32)
    group.add_argument("--offline-output-len", type=int, default=128)
    group.add_argument("--decode-len", type=int, default=128, help="batch-1 decode: generated tokens")
    group.add_argument("--prefill-len", type=int, default=1500, help="the one long prefill (max_tokens=1)")


def _add_serving_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("serve and pd")
    group.add_argument("--input-len", type=int, default=1000)
    group.add_argument("--output-len", type=int, default=64)
    group.add_argument("--num-prompts", type=int, default=16, help="per request rate")
    group.add_argument("--request-rate", nargs="+", type=bench_serve.parse_rate, default=[0.05, 0.1, 0.2])


def offline_shape(args: argparse.Namespace) -> OfflineShape:
    return OfflineShape(
        num_prompts=args.offline_prompts,
        input_len=args.offline_input_len,
        output_len=args.offline_output_len,
        decode_len=args.decode_len,
        prefill_len=args.prefill_len,
    )


def serving_load(args: argparse.Namespace) -> Load:
    return Load(args.input_len, args.output_len, args.num_prompts, tuple(args.request_rate))


def max_model_len(shape: OfflineShape, load: Load) -> int:
    """Room for the longest sequence of any part, in whole 256-token steps, at least 2048."""
    longest = max(shape.prefill_len + 1, shape.input_len + max(shape.output_len, shape.decode_len))
    longest = max(longest, load.input_len + load.output_len)
    return max(2048, -(-longest // 256) * 256)


def extra_args(raw: str) -> list[str]:
    return shlex.split(raw)


def run(args: argparse.Namespace) -> dict:
    from kvferry_bench.peers.run import run_peers

    return run_peers(args)
