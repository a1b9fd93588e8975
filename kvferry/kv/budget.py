"""The KV cache budget: what the user asked for, or a share of what memory is left.

Kept free of torch so the command line can parse sizes before loading anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from kvferry.errors import ConfigError

GIB = 1 << 30

# Binary multiples for K/M/G/T, KiB/MiB/GiB/TiB; decimal ones for KB/MB/GB/TB.
_SIZE_UNITS = {
    "": GIB,  # a bare number means GiB (the historical meaning of --kv-cache-memory)
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": GIB,
    "gib": GIB,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_memory_size(text: str) -> int:
    """Bytes in '2GiB', '512M', '1.5G' or '4000MB'; a bare number is GiB."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"cannot read {text!r} as a memory size; write e.g. 2GiB, 512MiB, 1.5G or 4000MB "
            "(a bare number is GiB)"
        )
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ConfigError(f"a memory size must be positive, not {text!r}")
    return size


class MemorySize(int):
    """A byte count that keeps the text it was read from: `str()` gives that text back,
    so a launcher passes `--kv-cache-memory 0.5` on to its instances as written (a bare
    number means GiB, so the byte count itself would not round-trip)."""

    text: str

    def __new__(cls, text: str) -> MemorySize:
        size = super().__new__(cls, parse_memory_size(text))
        size.text = text.strip()
        return size

    def __reduce__(self) -> tuple[type[MemorySize], tuple[str]]:
        return (MemorySize, (self.text,))  # pickled and copied as its text

    def __str__(self) -> str:
        return self.text


def format_bytes(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


class BudgetSource(Enum):
    ASKED = "asked"  # --kv-cache-memory / kv_cache_bytes
    FRACTION = "fraction"  # a fraction of the memory available after weights and activations
    BLOCKS = "blocks"  # num_gpu_blocks_override: a block count, no byte budget


@dataclass(frozen=True)
class KVBudget:
    """How one rank's KV bytes were chosen, with the measurements behind them."""

    kv_bytes: int
    source: BudgetSource
    available_bytes: int  # this rank's share of host memory left after weights and activations
    activation_peak_bytes: int  # measured by the profiling step
    fraction: float

    def describe(self) -> str:
        left = (
            f"{format_bytes(self.available_bytes)} available after weights and a "
            f"{format_bytes(self.activation_peak_bytes)} activation peak"
        )
        if self.source is BudgetSource.FRACTION:
            return f"{format_bytes(self.kv_bytes)} ({self.fraction:.0%} of {left})"
        if self.source is BudgetSource.ASKED:
            return f"{format_bytes(self.kv_bytes)} as asked ({left})"
        return f"a fixed block count ({left})"


def plan_kv_budget(
    asked_bytes: int | None,
    fraction: float,
    available_bytes: int,
    activation_peak_bytes: int,
    fixed_blocks: int | None = None,
) -> KVBudget:
    """The KV bytes for one rank. `available_bytes` is its share of memory left after the
    weights and the activation peak; asking for more than that is an error naming both.
    A fixed block count (num_gpu_blocks_override) needs no bytes: kv_bytes is then 0."""
    if fixed_blocks is not None:
        return KVBudget(0, BudgetSource.BLOCKS, available_bytes, activation_peak_bytes, fraction)
    if asked_bytes is not None and asked_bytes > available_bytes:
        raise ConfigError(
            f"--kv-cache-memory asks for {format_bytes(asked_bytes)} per rank, but only "
            f"{format_bytes(available_bytes)} is available after weights and the "
            f"{format_bytes(activation_peak_bytes)} activation peak"
        )
    if asked_bytes is not None:
        source, kv_bytes = BudgetSource.ASKED, asked_bytes
    else:
        source, kv_bytes = BudgetSource.FRACTION, int(fraction * available_bytes)
    return KVBudget(kv_bytes, source, available_bytes, activation_peak_bytes, fraction)
