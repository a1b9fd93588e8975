"""Offline part of ``kvferry bench peers``: the same token ids through each engine's driver.

Three workloads, each timed after a warm-up on as many other prompts of the same shape (so
that no prefix cache hit helps the timed run, and what an engine compiles per batch size is
compiled before it):

- ``throughput``: N prompts x M generated tokens, all submitted at once;
- ``decode_b1``: one prompt, D generated tokens (batch-1 decode);
- ``prefill``: one P-token prompt, one generated token.

Each engine runs in a process of its own, one after the other, on the same cores: the
vLLM driver (``vllm_driver.py``) under the vLLM venv's python, the llama.cpp driver
(``llamacpp_driver.py``, the GGUF itself, batch-1 workloads only) under the llama.cpp venv's
python, the kvferry driver under this python. All read one workloads file and write
timings in one format.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvferry_bench.peers.setup import Setup
from kvferry_bench.serve import make_prompts

logger = logging.getLogger(__name__)

VLLM_DRIVER = Path(__file__).with_name("vllm_driver.py")
LLAMACPP_DRIVER = Path(__file__).with_name("llamacpp_driver.py")
LOG_TAIL = 3000


class DriverError(RuntimeError):
    """An engine's driver process failed."""


@dataclass(frozen=True)
class OfflineShape:
    num_prompts: int = 64
    input_len: int = 32
    output_len: int = 128
    decode_len: int = 128
    prefill_len: int = 1500


def make_workloads(tokenizer, shape: OfflineShape, seed: int = 0) -> list[dict]:
    """The three workloads as token ids (random-word prompts cut to exact lengths)."""

    def ids(num: int, length: int, offset: int) -> list[list[int]]:
        return [list(p) for p in make_prompts(num, length, tokenizer, seed=seed * 100 + offset)]

    return [
        {
            "name": "throughput",
            "prompts": ids(shape.num_prompts, shape.input_len, 1),
            "warmup": ids(shape.num_prompts, shape.input_len, 2),  # same batch: compiled for it
            "max_tokens": shape.output_len,
        },
        {
            "name": "decode_b1",
            "prompts": ids(1, shape.input_len, 3),
            "warmup": ids(1, shape.input_len, 4),
            "max_tokens": shape.decode_len,
        },
        {
            "name": "prefill",
            "prompts": ids(1, shape.prefill_len, 5),
            "warmup": ids(1, shape.prefill_len, 6),
            "max_tokens": 1,
        },
    ]


def write_spec(setup: Setup, workloads: list[dict]) -> Path:
    """The workloads file every driver reads: model (and its GGUF), dtype, limits, threads, token ids."""
    spec = {
        "model": str(setup.model_dir.absolute()),
        "kvferry_model": str(setup.kvferry_model().absolute()),
        "gguf_file": str(setup.gguf_file.absolute()) if setup.gguf_file else None,
        "threads": setup.threads,
        "dtype": setup.dtype,
        "max_model_len": setup.max_model_len,
        "max_num_seqs": setup.max_num_seqs,
        "seed": setup.seed,
        "workloads": workloads,
    }
    path = setup.work_dir / "offline-workloads.json"
    path.write_text(json.dumps(spec))
    return path


def run_driver(command: list[str], out: Path, env: dict[str, str] | None, log: Path, timeout: float) -> dict:
    """Run one driver to completion; the result document it wrote to `out`."""
    logger.info("offline: %s (log %s)", " ".join(command), log)
    out.unlink(missing_ok=True)
    with log.open("wb") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if done.returncode != 0 or not out.is_file():
        tail = log.read_bytes()[-LOG_TAIL:].decode("utf-8", "replace")
        raise DriverError(f"{command[0]} exited with {done.returncode}; log {log}:\n{tail}")
    return json.loads(out.read_text())


def driver_command(
    engine: str, spec: Path, out: Path, setup: Setup
) -> tuple[list[str], dict[str, str] | None]:
    """`engine`'s driver command (not yet pinned) and its environment (None: this one's)."""
    if engine == "vllm":
        return [setup.vllm_bin("python"), str(VLLM_DRIVER), str(spec), str(out)], setup.vllm_env()
    if engine == "llamacpp":
        if setup.gguf_file is None:
            raise DriverError(f"llama.cpp runs a GGUF file, and {setup.model_dir} is not a GGUF model")
        return [setup.llamacpp_python(), str(LLAMACPP_DRIVER), str(spec), str(out)], None
    module = "kvferry_bench.peers.kvferry_driver"
    driver = [sys.executable, "-m", module, str(spec), str(out), *setup.kvferry_engine_args()]
    return [*setup.kvferry_env_argv(), *driver], None


def run_offline(engine: str, spec: Path, setup: Setup) -> dict:
    """Time `engine` on the workloads in `spec`, pinned to the setup's cores."""
    out = setup.work_dir / f"offline-{engine}.json"
    command, env = driver_command(engine, spec, out, setup)
    log = setup.work_dir / f"offline-{engine}.log"
    return run_driver([*setup.pin, *command], out, env, log, setup.timeout)
