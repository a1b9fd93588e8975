"""The CPU paged decode attention kernel (csrc/paged_decode.cpp): built for this machine on
first use, loaded as the `kvferry_kernels::paged_decode` operator.

Each decode query reads its keys and values in place from the KV cache through its block
table, in fp32 whatever the cache dtype: no gathered copy of the KV, no mask tensor, and
one parallel loop over (sequence, KV head) instead of the SDPA kernel's per-call set-up,
which dominated decode attention at batch 64 (docs/benchmarks.md, "Decode attention").

The library is compiled with the host's C++ compiler (`CXX`, default g++) for the host's
CPU (-march=native) and cached under `$XDG_CACHE_HOME/kvferry/kernels` (default
~/.cache) by a key of the source, torch's version, the compiler and the CPU's flags, so a
different CPU builds its own. If it cannot be built, decode attention stays on torch's
SDPA with one warning naming the cause.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from kvferry.kv.spec import Layout

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
BUILD_TIMEOUT_S = 300


@dataclass(frozen=True)
class CacheGeometry:
    """Where a key sits in a KV cache tensor, in elements: K at 0, V at `kv_stride`; the
    tensor's KV heads."""

    kv_heads: int
    block_size: int
    block_stride: int
    token_stride: int
    head_stride: int
    kv_stride: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor, layout: Layout) -> CacheGeometry:
        """NHD [2, blocks, block_size, heads, D]; HND [2, blocks, heads, block_size, D]."""
        token_dim, head_dim = (2, 3) if layout is Layout.NHD else (3, 2)
        return cls(
            kv_heads=kv_cache.shape[head_dim],
            block_size=kv_cache.shape[token_dim],
            block_stride=kv_cache.stride(1),
            token_stride=kv_cache.stride(token_dim),
            head_stride=kv_cache.stride(head_dim),
            kv_stride=kv_cache.stride(0),
        )


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: Layout,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    start_pos: torch.Tensor | None,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Attention of decode queries q [B, heads, D] over their cached keys: [B, heads, D].

    `block_table` [B, n] int64 names each sequence's blocks from the one holding position
    `start_pos` (None: 0); `seq_lens` counts positions including the query's own (already
    written). `window` > 0 limits the keys to the last `window` positions. The cache may
    store heads wider than D (padded groups): the first D values of each are read.
    """
    q = q.contiguous()
    out = torch.empty_like(q)
    geometry = CacheGeometry.of(kv_cache, layout)
    starts = start_pos if start_pos is not None else torch.zeros_like(seq_lens)
    torch.ops.kvferry_kernels.paged_decode(
        q,
        kv_cache,
        block_table.contiguous(),
        seq_lens,
        starts,
        out,
        geometry.kv_heads,
        geometry.block_size,
        geometry.block_stride,
        geometry.token_stride,
        geometry.head_stride,
        geometry.kv_stride,
        window,
        scale,
    )
    return out


@functools.cache
def decode_kernel_available() -> bool:
    """Build (once per machine) and load the kernel; False, with one warning, if it cannot."""
    try:
        torch.ops.load_library(str(_built_library()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("paged decode kernel unavailable, decode attention uses torch SDPA: %s", exc)
        return False
    return True


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


def _build_key(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = (SOURCE.read_bytes().decode(), torch.__version__, version, _cpu_flags())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def _built_library() -> Path:
    """The library for this machine, compiled unless a cached build exists (one process
    builds; others wait on the lock and load its result)."""
    compiler = _compiler()
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"paged_decode-{_build_key(compiler)}.so"
    with open(directory / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            _compile(compiler, library)
    return library


def _compile(compiler: str, library: Path) -> None:
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
    command += [str(SOURCE), "-o", str(partial)]
    for lib_dir in cpp_extension.library_paths():
        command += [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"]
    command += ["-lc10", "-ltorch_cpu", "-ltorch"]
    logger.info("building the paged decode kernel for this CPU (once; cached in %s)", library.parent)
    done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
    os.replace(partial, library)
