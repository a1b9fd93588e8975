"""Serving part of ``kvferry bench peers``: vLLM's own client against each engine's server.

For each engine in turn: start its OpenAI server (``vllm serve``, ``kvferry serve``, or
llama-cpp-python's ``python -m llama_cpp.server`` on the GGUF through ``llamacpp_server.py``,
which drops the request-id header vLLM's client sends and that server rejects, and the SSE
pings that client cannot parse) on the shared cores, wait until it answers (``/health``; llama.cpp's server has none:
``/v1/models``), run ``vllm bench serve --backend openai`` (random dataset, exact lengths,
ignore_eos, greedy) once per request rate, stop the server. Each client run saves vLLM's
result JSON; ``parse_bench_serve`` keeps the figures the report compares.

llama.cpp's server runs one request at a time (the others wait: it is started with
``--interrupt_requests False``, since by default a new request cuts the streaming one off),
and it ignores the client's ``ignore_eos``: a reply may end at EOS before ``output_len``
tokens, which the kept ``total_output_tokens`` shows.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvferry.entrypoints.disagg import Child, LaunchError, spawn, stop_all, wait_healthy
from kvferry.ports import free_port
from kvferry_bench.peers.setup import Setup

logger = logging.getLogger(__name__)

SERVED_NAME = "peers-bench"
LLAMACPP_SERVER = Path(__file__).with_name("llamacpp_server.py")  # llama_cpp.server, x-request-id dropped
LLAMACPP_READY_PATH = "/v1/models"  # llama_cpp.server has no /health
METRICS = ("ttft", "tpot", "itl", "e2el")
# What vLLM's `bench serve` result JSON holds (keys as vLLM 0.32 writes them) that we keep.
KEPT_KEYS = (
    "request_rate",
    "num_prompts",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(f"{stat}_{m}_ms" for m in METRICS for stat in ("mean", "median", "p99")),
)


@dataclass(frozen=True)
class Load:
    input_len: int = 1000
    output_len: int = 64
    num_prompts: int = 16
    rates: tuple[float, ...] = (0.05, 0.1, 0.2)


def llamacpp_server_command(setup: Setup, port: int) -> list[str]:
    """llama-cpp-python's OpenAI server on the setup's GGUF, one thread per core, pinned."""
    if setup.gguf_file is None:
        raise LaunchError(f"llama.cpp's server runs a GGUF file, and {setup.model_dir} is not a GGUF model")
    serve = [setup.llamacpp_python(), str(LLAMACPP_SERVER), "--model", str(setup.gguf_file.absolute())]
    serve += ["--model_alias", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port)]
    serve += ["--n_ctx", str(setup.max_model_len), "--n_batch", str(min(2048, setup.max_model_len))]
    serve += ["--n_threads", str(setup.threads), "--n_threads_batch", str(setup.threads)]
    # its default lets a new request cut off the one streaming: queue them instead
    serve += ["--interrupt_requests", "False", "--seed", str(setup.seed), "--verbose", "False"]
    return [*setup.pin, *serve]


def server_command(engine: str, setup: Setup, port: int) -> list[str]:
    """`vllm serve`, `kvferry serve` or llama.cpp's server of the setup's model, pinned to its cores."""
    if engine == "llamacpp":
        return llamacpp_server_command(setup, port)
    common = ["--port", str(port), "--served-model-name", SERVED_NAME, "--dtype", setup.dtype]
    common += ["--max-model-len", str(setup.max_model_len), "--max-num-seqs", str(setup.max_num_seqs)]
    common += ["--seed", str(setup.seed)]
    model = str(setup.model_dir.absolute())
    if engine == "vllm":
        serve = [setup.vllm_bin("vllm"), "serve", model, *common, *setup.vllm_serve_args]
        return [*setup.vllm_env_argv(), *setup.pin, *serve]
    kvferry_model = str(setup.kvferry_model().absolute())
    serve = [sys.executable, "-m", "kvferry.entrypoints.cli", "serve", kvferry_model, *common]
    return [*setup.kvferry_env_argv(), *setup.pin, *serve, *setup.kvferry_engine_args()]


def client_command(setup: Setup, url: str, load: Load, rate_index: int, out: Path) -> list[str]:
    """`vllm bench serve` at the `rate_index`-th request rate, saving its result JSON as `out`.

    Each rate draws its own prompts (seed + rate index): the prompts of one rate would be
    in both engines' prefix caches at the next, and a cached 1,000-token prompt measures no
    prefill. Both engines get the same prompts at the same rate."""
    rate = load.rates[rate_index]
    command = [setup.vllm_bin("vllm"), "bench", "serve", "--backend", "openai", "--base-url", url]
    command += ["--endpoint", "/v1/completions", "--model", SERVED_NAME]
    command += ["--tokenizer", str(setup.model_dir.absolute()), "--dataset-name", "random"]
    command += ["--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len)]
    command += ["--random-range-ratio", "0", "--ignore-eos", "--num-prompts", str(load.num_prompts)]
    command += ["--temperature", "0"]  # greedy: vLLM's client no longer sends it by default
    command += ["--request-rate", _rate_arg(rate), "--seed", str(setup.seed + rate_index), "--disable-tqdm"]
    command += ["--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99"]
    command += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    return [*setup.vllm_env_argv(), *command]


def _rate_arg(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def parse_bench_serve(path: Path) -> dict:
    """The kept figures of one `vllm bench serve` result JSON (missing keys are None)."""
    raw = json.loads(path.read_text())
    kept = {key: raw.get(key) for key in KEPT_KEYS}
    kept["request_rate"] = float(kept["request_rate"]) if kept["request_rate"] is not None else None
    return kept


def run_client(setup: Setup, url: str, load: Load, rate_index: int, tag: str) -> dict:
    rate = load.rates[rate_index]
    out = setup.work_dir / f"serve-{tag}-rate{_rate_arg(rate)}.json"
    log = out.with_suffix(".log")
    out.unlink(missing_ok=True)
    command = client_command(setup, url, load, rate_index, out)
    logger.info("serving: %s at %s req/s (log %s)", tag, _rate_arg(rate), log)
    with log.open("wb") as sink:
        subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=setup.timeout, check=False)
    if not out.is_file():
        tail = log.read_bytes()[-3000:].decode("utf-8", "replace")
        raise RuntimeError(f"vllm bench serve wrote no result; log {log}:\n{tail}")
    return parse_bench_serve(out)


def wait_answering(child: Child, path: str, deadline: float) -> None:
    """Return once `child` answers GET `path` with 200; LaunchError if it exits or the deadline
    passes. One client for the wait (a client per request builds an SSL context, ~50 ms of CPU)."""
    import httpx

    proc = child.started()
    with httpx.Client(timeout=2.0) as http:
        while proc.poll() is None:
            try:
                if http.get(child.url + path).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{child.name} did not answer {path} in time; log {child.log}:\n{child.log_tail()}"
                )
            time.sleep(0.2)
    raise LaunchError(
        f"{child.name} exited with code {proc.returncode} while starting; log {child.log}:\n{child.log_tail()}"
    )


def bench_server(engine: str, setup: Setup, load: Load, startup_timeout: float = 900.0) -> list[dict]:
    """Start `engine`'s server, run the client at every rate, stop it; one result per rate."""
    port = free_port()
    log = setup.work_dir / f"server-{engine}.log"
    child = Child(engine, server_command(engine, setup, port), f"http://127.0.0.1:{port}", log)
    spawn(child)
    try:
        begin = time.monotonic()
        if engine == "llamacpp":
            wait_answering(child, LLAMACPP_READY_PATH, begin + startup_timeout)
        else:
            wait_healthy([child], begin + startup_timeout, threading.Event())
        logger.info("%s server ready in %.0f s", engine, time.monotonic() - begin)
        return [run_client(setup, child.url, load, index, engine) for index in range(len(load.rates))]
    finally:
        stop_all([child], grace=30.0)
