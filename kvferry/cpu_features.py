"""What this CPU can do, read at run time (machines of one kind differ: some have AVX-512
BF16 and AMX, some only AVX2): its flags from /proc/cpuinfo, for logs and benchmark
results, and whether torch's oneDNN computes half precision natively, which decides the
compute dtype.

`$KVFERRY_MAX_ISA` (avx2, avx512 or avx512_bf16) caps what kvferry uses: the flags above
the level are dropped from `read_cpu_features`, so every choice made from them (which
kernel build loads, how a kernel is built here, the int4 kernel, half-precision compute,
the capture decision's key) is the one a CPU of that level gets. An AVX-512 host then
runs the AVX2 paths an AVX2-only CPU runs (its memory and clocks stay its own). torch's
own operators follow `ATEN_CPU_CAPABILITY` and oneDNN's `ONEDNN_MAX_CPU_ISA`, which the
`kvferry` command sets from the cap when they are unset (`torch_dispatch_caps`);
`host_cpu_features` reads the flags uncapped."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from kvferry.errors import ConfigError

if TYPE_CHECKING:  # the flags need no torch: the command line and benchmarks read them
    import torch

CPUINFO = Path("/proc/cpuinfo")
MAX_ISA_ENV = "KVFERRY_MAX_ISA"
WIDE_PREFIXES = ("avx512", "amx")


class IsaCap(str, Enum):
    """A level kvferry may be held to; the names of the kernels' prebuilt levels."""

    AVX2 = "avx2"
    AVX512 = "avx512"
    AVX512_BF16 = "avx512_bf16"

    @property
    def wide_flags(self) -> frozenset[str]:
        """The AVX-512 and AMX flags a CPU of this level keeps."""
        avx512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})
        return {
            IsaCap.AVX2: frozenset[str](),
            IsaCap.AVX512: avx512,
            IsaCap.AVX512_BF16: avx512 | {"avx512_bf16"},
        }[self]

    def torch_dispatch(self) -> dict[str, str]:
        """torch's and oneDNN's variables that hold their operators to this level."""
        aten = "avx2" if self is IsaCap.AVX2 else "avx512"
        onednn = {IsaCap.AVX2: "AVX2", IsaCap.AVX512: "AVX512_CORE", IsaCap.AVX512_BF16: "AVX512_CORE_BF16"}
        return {"ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn[self]}


def isa_cap() -> IsaCap | None:
    """The level $KVFERRY_MAX_ISA holds kvferry to (None: the CPU's own)."""
    raw = os.environ.get(MAX_ISA_ENV, "").strip().lower()
    if not raw:
        return None
    try:
        return IsaCap(raw)
    except ValueError:
        levels = ", ".join(cap.value for cap in IsaCap)
        raise ConfigError(f"{MAX_ISA_ENV} must be one of {levels}, not {raw!r}") from None


def torch_dispatch_caps() -> dict[str, str]:
    """Under a cap, torch's and oneDNN's variables not already set, set (call before torch is
    imported: they are read once); the ones set."""
    cap = isa_cap()
    if cap is None:
        return {}
    added = {k: v for k, v in cap.torch_dispatch().items() if k not in os.environ}
    os.environ.update(added)
    return added


def native_half_precision(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs `dtype` (bfloat16, float16) GEMMs in hardware on this CPU.
    Without it (AVX2 only) a bf16 GEMM runs ~7x slower than float32 (measured 10 vs 67
    GFLOP/s per core on an AVX2 EPYC); with AVX-512 BF16 and AMX, 2.5-4x faster (SmolLM2's
    shapes, batch 1 and 64, on a Xeon with amx_bf16)."""
    import torch

    native_flags = {torch.bfloat16: {"avx512_bf16", "amx_bf16"}, torch.float16: {"avx512_fp16", "amx_fp16"}}
    if isa_cap() is not None and not read_cpu_features().flags & native_flags.get(dtype, set()):
        return False  # held below the level that computes it
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


class CPUFeatureSummary(TypedDict):
    avx2: bool
    avx512: bool
    bf16_flags: list[str]  # avx512_bf16, amx_bf16 where present
    wide_flags: list[str]  # every avx512* and amx* flag


@dataclass(frozen=True)
class CPUFeatures:
    flags: frozenset[str]

    def summary(self) -> CPUFeatureSummary:
        """The flags that decide kernel speed, for logs and benchmark results."""
        wide = sorted(f for f in self.flags if f.startswith(("avx512", "amx")))
        return {
            "avx2": "avx2" in self.flags,
            "avx512": any(f.startswith("avx512") for f in wide),
            "bf16_flags": sorted(self.flags & {"avx512_bf16", "amx_bf16"}),
            "wide_flags": wide,
        }


def host_cpu_features(cpuinfo: Path = CPUINFO) -> CPUFeatures:
    """The first CPU's flags, whatever the cap; none where /proc/cpuinfo cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return CPUFeatures(frozenset())
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return CPUFeatures(frozenset(line.split(":", 1)[-1].split()))


def read_cpu_features(cpuinfo: Path = CPUINFO) -> CPUFeatures:
    """The flags kvferry may use: the CPU's, less those above $KVFERRY_MAX_ISA's level."""
    host = host_cpu_features(cpuinfo)
    cap = isa_cap()
    if cap is None:
        return host
    kept = {f for f in host.flags if not f.startswith(WIDE_PREFIXES) or f in cap.wide_flags}
    return CPUFeatures(frozenset(kept))
