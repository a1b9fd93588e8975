"""Builds and loads the C++ CPU kernels in csrc/ (one shared library per source file).

Each source is compiled with the host's C++ compiler (`CXX`, default g++) for the host's
CPU (-march=native) and cached under `$XDG_CACHE_HOME/kvferry/kernels` (default
~/.cache) by a key of the source, torch's version, the compiler and the CPU's flags, so a
different CPU, or an edited source, builds its own. Callers decide what to do when a
build fails (kvferry.model.layers.decode_kernel, prefill_kernel: torch's SDPA instead).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
BUILD_TIMEOUT_S = 300
# What load() raises when a kernel cannot be built or loaded.
BUILD_ERRORS = (OSError, RuntimeError, subprocess.SubprocessError)


def load(source: Path) -> None:
    """Build `source` for this machine (once; cached) and load its operators into torch.ops."""
    torch.ops.load_library(str(built_library(source)))  # type: ignore[no-untyped-call]  # unannotated in torch


def loaded(source: Path, log: logging.Logger, fallback: str) -> bool:
    """Whether `source`'s operators could be built and loaded here; if not, one warning on
    the caller's `log` naming the cause and what runs instead (`fallback`)."""
    try:
        load(source)
    except BUILD_ERRORS as exc:
        log.warning("%s kernel unavailable, %s: %s", source.stem.replace("_", " "), fallback, exc)
        return False
    return True


def built_library(source: Path) -> Path:
    """The library of `source` for this machine, compiled unless a cached build exists (one
    process builds; others wait on the lock and load its result)."""
    compiler = _compiler()
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{source.stem}-{_build_key(source, compiler)}.so"
    with open(directory / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            _compile(source, compiler, library)
    return library


def _compiler() -> str:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise OSError(f"C++ compiler {compiler!r} not found")
    return compiler


def _cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "kvferry" / "kernels"


def _cpu_flags() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith("flags")), "")


def _build_key(source: Path, compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = (source.read_bytes().decode(), torch.__version__, version, _cpu_flags())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def _compile(source: Path, compiler: str, library: Path) -> None:
    from torch.utils import cpp_extension

    partial = library.with_suffix(f".{os.getpid()}.tmp")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fno-math-errno: the softmax's exp vectorizes (glibc's vector math)
    command = [
        compiler,
        "-O3",
        "-march=native",
        "-fno-math-errno",
        "-fopenmp",
        "-shared",
        "-fPIC",
        "-std=c++17",
    ]
    command += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in cpp_extension.include_paths())]
    command += [str(source), "-o", str(partial)]
    for lib_dir in cpp_extension.library_paths():
        command += [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"]
    command += ["-lc10", "-ltorch_cpu", "-ltorch"]
    logger.info("building %s for this CPU (once; cached in %s)", source.name, library.parent)
    done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
    os.replace(partial, library)
