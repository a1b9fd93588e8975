"""The profiling step's activation peak, kept across starts so that a start of a model it
has measured before skips that step (a full-budget prefill: 3-4 s of a 9-11 s start of
SmolLM2 on 2 cores).

The peak depends on what the step runs and on the machine, not on free memory: the key is
--capture auto's (kvferry.engine.capture_cache: the model's shapes, dtype and quantization,
the CPU's flags and cores, kvferry's and torch's versions, the options that change a step,
among them the step's token budget and sequence limit) plus the model length, which sets
the profiling prompts. Free memory is read at every start: the room for the KV cache is
each rank's share of it less the stored peak. Files live under the cache directory
(kvferry.cache_dir; --cache-dir) in memory-profile/<key>.json, written atomically; an
unreadable one is ignored (the start profiles again and rewrites it). Without a cache
directory every start profiles.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from kvferry.cache_dir import write_json_atomically
from kvferry.config import EngineConfig
from kvferry.engine.capture_cache import KEY_DIGITS, capture_cache_key

logger = logging.getLogger(__name__)

RECORD_FORMAT = 1  # bumped when what a record means changes


@dataclass(frozen=True)
class StoredPeak:
    activation_peak_bytes: int
    path: Path


class ProfileCache:
    """The stored activation peaks under one cache directory."""

    def __init__(self, root: Path, key: str):
        self.path = root / "memory-profile" / f"{key}.json"

    def load(self) -> StoredPeak | None:
        """The peak stored for this key; None when there is none or it cannot be read."""
        try:
            record = json.loads(self.path.read_text())
            peak = record["activation_peak_bytes"]
            if record["format"] != RECORD_FORMAT or not isinstance(peak, int) or peak < 0:
                raise ValueError(f"not a format-{RECORD_FORMAT} record with a peak: {record!r}")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as err:
            logger.warning("ignoring the unreadable memory profile %s: %s", self.path, err)
            return None
        return StoredPeak(peak, self.path)

    def store(self, activation_peak_bytes: int) -> None:
        """Keep a measured peak (atomically); a failure only costs the next start time."""
        record = {"format": RECORD_FORMAT, "activation_peak_bytes": activation_peak_bytes}
        try:
            write_json_atomically(self.path, record)
        except OSError as err:
            logger.warning("could not keep the memory profile in %s: %s", self.path.parent, err)


def profile_key(config: EngineConfig) -> str:
    """Everything the profiling step's peak depends on, as a digest."""
    described = {"step": asdict(capture_cache_key(config)), "max_model_len": config.model.max_model_len}
    text = json.dumps(described, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_DIGITS]


def profile_cache_for(config: EngineConfig) -> ProfileCache | None:
    """This engine's stored peak, when a cache directory is configured."""
    root = config.compilation.cache_dir
    return None if root is None else ProfileCache(Path(root), profile_key(config))
