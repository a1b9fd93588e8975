"""Where an engine's start-up time went, as one log line per instance.

EngineCore laps a StartupClock at the end of each phase: the executor (worker processes,
weights), the memory-profiling step, the KV cache and connector (NIXL agents register their
memory there), warm-up, and --capture auto's decision. Warm-up includes compiling the decode
program; the compile seconds the ranks report are shown apart. The time the process spent
before the engine began (imports, model config, tokenizer) is read from the kernel's record
of when the process started.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

logger = logging.getLogger(__name__)


class StartupPhase(str, Enum):
    BEFORE_ENGINE = "imports, config, tokenizer"
    EXECUTOR = "executor and weights"
    MEMORY_PROFILE = "memory profile"
    KV_CACHE = "KV cache and connector"
    WARM_UP = "warm-up"
    CAPTURE_DECISION = "capture decision"


def process_age_s(proc: Path = Path("/proc")) -> float | None:
    """Seconds since this process started (Linux); None where the kernel does not say."""
    try:
        stat = (proc / "self" / "stat").read_text()
        uptime = float((proc / "uptime").read_text().split()[0])
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


@dataclass
class StartupClock:
    """Laps of the engine's start-up, in order."""

    before_engine_s: float | None = field(default_factory=process_age_s)
    laps: list[tuple[StartupPhase, float]] = field(default_factory=list)
    _last: float = field(default_factory=time.perf_counter)

    def lap(self, phase: StartupPhase) -> None:
        now = time.perf_counter()
        self.laps.append((phase, now - self._last))
        self._last = now

    def report(self, compile_s: float, decision: str) -> StartupReport:
        return StartupReport(self.before_engine_s, tuple(self.laps), compile_s, decision, self._last)


@dataclass(frozen=True)
class StartupReport:
    """One engine's start-up: the time before the engine, each phase's, compiling's share."""

    before_engine_s: float | None
    phases: tuple[tuple[StartupPhase, float], ...]
    compile_s: float  # of warm-up and the capture decision: compiling the decode program
    decision: str  # the captured forward's, as its log line says it
    ended_at: float  # time.perf_counter() when the last phase ended

    @property
    def engine_s(self) -> float:
        return sum(seconds for _, seconds in self.phases)

    @property
    def total_s(self) -> float:
        return self.engine_s + (self.before_engine_s or 0.0)

    def process_age_s(self) -> float | None:
        """Seconds since the process began, now: the start-up total plus the time since it
        ended, on one clock (the kernel's record counts whole ticks, too coarse to tell a
        short answer from the end of start-up); None where the process start is unknown."""
        if self.before_engine_s is None:
            return None
        return self.total_s + time.perf_counter() - self.ended_at

    def seconds(self) -> dict[str, float]:
        """Each phase's seconds by name (the compile apart), for benchmark results."""
        named = {phase.value: seconds for phase, seconds in self.phases}
        if self.before_engine_s is not None:
            named = {StartupPhase.BEFORE_ENGINE.value: self.before_engine_s, **named}
        return {**named, "compiling": self.compile_s}

    def describe(self) -> str:
        """The start-up log line."""
        parts = []
        if self.before_engine_s is not None:
            parts.append(f"{StartupPhase.BEFORE_ENGINE.value} {self.before_engine_s:.1f}s")
        for phase, seconds in self.phases:
            extra = f" (compiling {self.compile_s:.1f}s)" if phase is StartupPhase.WARM_UP else ""
            parts.append(f"{phase.value} {seconds:.1f}s{extra}")
        return f"start-up {self.total_s:.1f}s: {', '.join(parts)}; {self.decision}"
