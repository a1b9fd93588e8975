"""What this CPU can do, read at run time (machines of one kind differ: some have AVX-512
BF16 and AMX, some only AVX2): its flags from /proc/cpuinfo, for logs and benchmark
results, and whether torch's oneDNN computes half precision natively, which decides the
compute dtype."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:  # the flags need no torch: the command line and benchmarks read them
    import torch

CPUINFO = Path("/proc/cpuinfo")


def native_half_precision(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs `dtype` (bfloat16, float16) GEMMs in hardware on this CPU.
    Without it (AVX2 only) a bf16 GEMM runs ~7x slower than float32 (measured 10 vs 67
    GFLOP/s per core on an AVX2 EPYC); with AVX-512 BF16 and AMX, 2.5-4x faster (SmolLM2's
    shapes, batch 1 and 64, on a Xeon with amx_bf16)."""
    import torch

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


def read_cpu_features(cpuinfo: Path = CPUINFO) -> CPUFeatures:
    """The first CPU's flags; none where /proc/cpuinfo cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return CPUFeatures(frozenset())
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return CPUFeatures(frozenset(line.split(":", 1)[-1].split()))
