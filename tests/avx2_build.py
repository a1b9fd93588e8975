"""A CPU kernel built with AVX2 flags, run in a process of its own: what an AVX2-only CPU
runs, checked on any CPU with AVX2 (the library's operators would clash with this process's
build of the same kernel)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvferry.cpu_features import read_cpu_features
from kvferry.model.layers import cpu_kernels

REPO_ROOT = Path(__file__).parent.parent


def outputs_of_the_avx2_build(source: Path, script: str, cases: list, tmp_path: Path) -> list:
    """Build `source` for AVX2 into `tmp_path` and run `script` (python -c) with argv: the
    library, a file of `cases` (torch.save), the file it must save one output per case to;
    the outputs. Skips where the CPU lacks AVX2."""
    if not cpu_kernels.AVX2.runs_on(read_cpu_features()):
        pytest.skip("this CPU lacks AVX2")
    library = cpu_kernels.build_prebuilt(source, cpu_kernels.AVX2, tmp_path)
    torch.save(cases, tmp_path / "cases.pt")
    run = [sys.executable, "-c", script, str(library), str(tmp_path / "cases.pt"), str(tmp_path / "avx2.pt")]
    subprocess.run(run, check=True, timeout=120, cwd=REPO_ROOT)
    outputs: list = torch.load(tmp_path / "avx2.pt")
    assert len(outputs) == len(cases)
    return outputs
