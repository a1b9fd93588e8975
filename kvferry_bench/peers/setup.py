"""What the engines of ``kvferry bench peers`` share: model directory, limits, cores."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.config import WeightQuantization
from kvferry.cpu_features import MAX_ISA_ENV, IsaCap
from kvferry_bench.peers.install import vllm_env


@dataclass(frozen=True)
class Setup:
    model_dir: Path  # the HF directory both engines load
    dtype: str
    work_dir: Path  # workloads, drivers' results, logs
    cores: str  # e.g. "0-1": both engines pinned here, one after the other
    max_model_len: int
    max_num_seqs: int
    kv_cache_gib: float
    seed: int = 0
    vllm_venv: Path | None = None
    llamacpp_venv: Path | None = None
    gguf_file: Path | None = None  # the model's GGUF, which llama.cpp loads (None: not a GGUF model)
    kvferry_args: list[str] = field(default_factory=list)  # more `kvferry serve` / LLM options
    vllm_serve_args: list[str] = field(default_factory=list)  # more `vllm serve` options
    timeout: float = 1800.0
    isa_cap: IsaCap | None = None  # kvferry and llama.cpp held to this level (--max-isa)

    @property
    def pin(self) -> list[str]:
        """The command prefix that keeps a process (and its children) on `cores`."""
        return ["taskset", "-c", self.cores]

    @property
    def threads(self) -> int:
        """One thread per core of `cores` (what kvferry runs with when pinned there)."""
        from kvferry.worker.cpu_placement import parse_core_list

        return len(parse_core_list(self.cores))

    def llamacpp_python(self) -> str:
        assert self.llamacpp_venv is not None, "llama.cpp is not installed for this run"
        return str(self.llamacpp_venv / "bin" / "python")

    def vllm_bin(self, name: str) -> str:
        assert self.vllm_venv is not None, "vLLM is not installed for this run"
        return str(self.vllm_venv / "bin" / name)

    def vllm_env(self) -> dict[str, str]:
        """vLLM's environment: CPU platform, the same KV cache size and cores as kvferry."""
        return vllm_env(
            {"VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gib:g}", "VLLM_CPU_OMP_THREADS_BIND": self.cores}
        )

    def vllm_env_argv(self) -> list[str]:
        """`env K=V ...` setting vLLM's own variables, for commands started without an env."""
        own = {k: v for k, v in self.vllm_env().items() if os.environ.get(k) != v}
        return ["env", *(f"{k}={v}" for k, v in sorted(own.items()))]

    def kvferry_model(self) -> Path:
        """What kvferry loads: the GGUF itself under `--quantization gguf` (the mode keeps
        the file's blocks), else the directory every engine loads."""
        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument("--quantization", type=WeightQuantization, default=WeightQuantization.NONE)
        known, _ = parser.parse_known_args(self.kvferry_args)
        if known.quantization is WeightQuantization.GGUF and self.gguf_file is not None:
            return self.gguf_file
        return self.model_dir

    def kvferry_env_argv(self) -> list[str]:
        """`env K=V ...` holding a kvferry process to the setup's level (torch's and oneDNN's
        operators too); nothing without one."""
        if self.isa_cap is None:
            return []
        held = {MAX_ISA_ENV: self.isa_cap.value, **self.isa_cap.torch_dispatch()}
        return ["env", *(f"{k}={v}" for k, v in sorted(held.items()))]

    def kvferry_engine_args(self) -> list[str]:
        return ["--kv-cache-memory", f"{self.kv_cache_gib:g}", *self.kvferry_args]


def all_cores() -> str:
    """This process's allowed cores as a list, e.g. '0-1' or '0,2,4'."""
    from kvferry.worker.cpu_placement import format_core_list

    return format_core_list(tuple(sorted(os.sched_getaffinity(0))))
