"""Builds and loads the C++ CPU kernels in csrc/ (one shared library per source file; their
operators all in `torch.ops.kvferry_cpu`; the vector helpers they share in csrc/cpu_vec.h).

Two ways to a library, tried in this order for each kernel:

- prebuilt: `kvferry build-kernels` compiles every kernel for explicit instruction-set
  levels (ISA_LEVELS: a portable AVX2/FMA build, AVX-512, AVX-512 BF16; explicit -m flags,
  never -march=native) into a directory, `$KVFERRY_KERNELS_DIR` or the kernels cache. At
  run time the best level this CPU supports (kvferry.cpu_features, read at run time) whose
  library is there is loaded, without a compiler; a library for an ISA the CPU lacks is
  never loaded. Names carry a key of the sources and torch's version, so a stale build is
  not picked up.
- built here on first use for this CPU (-march=native, or $KVFERRY_MAX_ISA's level's
  flags (kvferry.cpu_features), with the host's C++ compiler `CXX`,
  default g++) and cached under `$XDG_CACHE_HOME/kvferry/kernels` (default ~/.cache) by a
  key of the sources, torch's version, the compiler and the CPU's flags. `build_ahead`
  starts the builds a model will need side by side (one compiler process each), so a cold
  start waits for the slowest build, not for their sum; a build holds its own lock.

Callers decide what to do when neither works (decode_kernel, prefill_kernel: torch's SDPA;
int4_kernel: torch's int4 kernel), with one warning (`loaded`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvferry.cpu_features import CPUFeatures, isa_cap, read_cpu_features

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SHARED_HEADER = CSRC / "cpu_vec.h"
KERNEL_SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
BUILD_TIMEOUT_S = 300  # a build on first use, while an engine starts
AHEAD_OF_TIME_TIMEOUT_S = 3600  # `kvferry build-kernels`: nothing waits on it but its caller
KERNELS_DIR_ENV = "KVFERRY_KERNELS_DIR"
# What load() raises when a kernel cannot be built or loaded.
BUILD_ERRORS = (OSError, RuntimeError, subprocess.SubprocessError)


@dataclass(frozen=True)
class IsaLevel:
    """An instruction-set level a kernel is prebuilt for: the compiler's flags, and the
    /proc/cpuinfo flags a CPU needs to run the result."""

    name: str
    compile_flags: tuple[str, ...]
    cpu_flags: frozenset[str]

    def runs_on(self, cpu: CPUFeatures) -> bool:
        return self.cpu_flags <= cpu.flags


_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX512_FLAGS = (*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
AVX2 = IsaLevel("avx2", _AVX2_FLAGS, frozenset({"avx2", "fma", "f16c"}))
AVX512 = IsaLevel("avx512", _AVX512_FLAGS, AVX2.cpu_flags | {"avx512f", "avx512bw", "avx512vl", "avx512dq"})
AVX512_BF16 = IsaLevel("avx512_bf16", (*_AVX512_FLAGS, "-mavx512bf16"), AVX512.cpu_flags | {"avx512_bf16"})
ISA_LEVELS = (AVX512_BF16, AVX512, AVX2)  # best first


@dataclass(frozen=True)
class KernelLibrary:
    """A kernel's library and where it came from: an ISA level's prebuilt build, or None
    for a build made here for this CPU."""

    path: Path
    isa: IsaLevel | None

    def describe(self) -> str:
        return f"prebuilt for {self.isa.name}" if self.isa else "built for this CPU"


def load(source: Path, cpu: CPUFeatures | None = None) -> KernelLibrary:
    """Load `source`'s operators into torch.ops: the best prebuilt library this CPU runs,
    else a library built here (once; cached)."""
    prebuilt = find_prebuilt(source, cpu or read_cpu_features())
    if prebuilt is not None:
        try:
            _load_library(prebuilt.path)
            return prebuilt
        except OSError as exc:  # the dynamic loader refused it (e.g. a damaged file)
            logger.warning("prebuilt %s unusable, building for this CPU: %s", prebuilt.path, exc)
    library = KernelLibrary(built_library(source), None)
    _load_library(library.path)
    return library


def _load_library(path: Path) -> None:
    import torch

    torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]  # unannotated in torch


def loaded(source: Path, log: logging.Logger, fallback: str) -> bool:
    """Whether `source`'s operators could be loaded here; if not, one warning on the
    caller's `log` naming the cause and what runs instead (`fallback`)."""
    try:
        library = load(source)
    except BUILD_ERRORS as exc:
        log.warning("%s kernel unavailable, %s: %s", source.stem.replace("_", " "), fallback, exc)
        return False
    log.info("%s kernel: %s (%s)", source.stem.replace("_", " "), library.describe(), library.path)
    return True


def kernel_dirs() -> list[Path]:
    """Where prebuilt libraries are looked for: $KVFERRY_KERNELS_DIR (an image's), then the
    kernels cache (`kvferry build-kernels`' default)."""
    shipped = os.environ.get(KERNELS_DIR_ENV)
    return [Path(shipped), cache_dir()] if shipped else [cache_dir()]


def find_prebuilt(source: Path, cpu: CPUFeatures, dirs: list[Path] | None = None) -> KernelLibrary | None:
    """The prebuilt library of `source` for the best ISA level `cpu` runs, if one is there."""
    for isa in ISA_LEVELS:
        if not isa.runs_on(cpu):
            continue
        for directory in kernel_dirs() if dirs is None else dirs:
            path = directory / prebuilt_name(source, isa)
            if path.is_file():
                return KernelLibrary(path, isa)
    return None


def prebuilt_name(source: Path, isa: IsaLevel) -> str:
    """The file name of `source` built for `isa`, keyed by the sources and torch's version
    (no compiler needed to compute it)."""
    key = _key(source, (isa.name,))
    return f"{source.stem}-{isa.name}-{key}.so"


def build_prebuilt(source: Path, isa: IsaLevel, out_dir: Path) -> Path:
    """Compile `source` for `isa` (explicit flags) into `out_dir`, replacing an older build."""
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / prebuilt_name(source, isa)
    _compile(source, _compiler(), library, isa.compile_flags, AHEAD_OF_TIME_TIMEOUT_S)
    return library


def build_ahead(sources: Iterable[Path]) -> list[threading.Thread]:
    """Start building, each in a thread of its own, every one of `sources` this CPU has no
    prebuilt library for; `load` then waits on that build's lock instead of compiling.
    A build that fails here is tried (and its error reported) again by `load`."""
    cpu = read_cpu_features()
    missing = [source for source in sources if find_prebuilt(source, cpu) is None]
    threads = [threading.Thread(target=_build_quietly, args=(source,), daemon=True) for source in missing]
    for thread in threads:
        thread.start()
    return threads


def _build_quietly(source: Path) -> None:
    try:
        built_library(source)
    except BUILD_ERRORS:
        pass  # load() builds again and names the error where the kernel is needed


def built_library(source: Path) -> Path:
    """The library of `source` for this machine, compiled unless a cached build exists (one
    thread or process builds it; others wait on its lock and load its result)."""
    compiler = _compiler()
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{source.stem}-{_key(source, (_compiler_version(compiler), _cpu_flags()))}.so"
    with open(library.with_suffix(".lock"), "w") as lock:  # each open holds its own flock
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            logger.info("building %s for this CPU (once; cached in %s)", source.name, library.parent)
            _compile(source, compiler, library, native_flags(), BUILD_TIMEOUT_S)
    return library


def native_flags() -> tuple[str, ...]:
    """How a build here targets this CPU: -march=native, or under $KVFERRY_MAX_ISA the
    capped level's explicit flags (the compiler sees the whole CPU)."""
    cap = isa_cap()
    if cap is None:
        return ("-march=native",)
    return next(isa.compile_flags for isa in ISA_LEVELS if isa.name == cap.value)


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "kvferry" / "kernels"


def _compiler() -> str:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise OSError(f"C++ compiler {compiler!r} not found")
    return compiler


@functools.cache
def _compiler_version(compiler: str) -> str:
    """`compiler --version`, asked once per process (every kernel's key holds it)."""
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout


def _cpu_flags() -> str:
    return " ".join(sorted(read_cpu_features().flags))


def _key(source: Path, extra: tuple[str, ...]) -> str:
    import torch

    abi = str(int(torch._C._GLIBCXX_USE_CXX11_ABI))
    parts = (source.read_text(), SHARED_HEADER.read_text(), torch.__version__, abi, *extra)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def _compile(source: Path, compiler: str, library: Path, isa_flags: tuple[str, ...], timeout_s: int) -> None:
    import torch
    from torch.utils import cpp_extension

    partial = library.with_suffix(f".{os.getpid()}.tmp")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fno-math-errno: the softmax's exp vectorizes (glibc's vector math)
    command = [compiler, "-O3", *isa_flags, "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
    command += [
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{CSRC}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
    ]
    command += [str(source), "-o", str(partial)]
    for lib_dir in cpp_extension.library_paths():
        command += [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"]
    command += ["-lc10", "-ltorch_cpu", "-ltorch"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
    os.replace(partial, library)
