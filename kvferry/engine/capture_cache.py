"""--capture auto's decision, kept across starts so that no start compiles a program it
then throws away.

Measuring compiled against eager needs the compiled program, so the first start of a model
on a machine compiles and measures; the decision is then stored under the cache directory
(kvferry.cache_dir; --cache-dir) in capture/<key>.json. The key is everything the timing
depends on: the model's shapes (architecture, its config, dtype, weight quantization), the
CPU (its flags, the cores this process may use), kvferry's and torch's versions, and the
options that change the decode step (device, tensor parallelism, threads, block size,
layout, allocator, connector, batch limits). A later start with the same key follows the
stored decision before warm-up: `eager` compiles nothing, `compiled` compiles only the
program it keeps and times nothing. A changed model, machine, version or option is a new key.

Files are written atomically (temp file + rename); an unreadable one is ignored (the start
measures again and rewrites it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import torch

from kvferry.cache_dir import write_json_atomically
from kvferry.config import CaptureMode, EngineConfig
from kvferry.cpu_features import read_cpu_features
from kvferry.worker.capture import CaptureDecision, StepTiming

logger = logging.getLogger(__name__)

KEY_DIGITS = 24  # hex digits of the key's SHA-256 naming its file


@dataclass(frozen=True)
class CaptureCacheKey:
    """What a stored decision depends on; its digest names the file."""

    model: str  # digest of the architecture, its config, dtype and weight quantization
    cpu: str  # digest of the CPU flags
    cores: int  # cores this process may run on
    kvferry_version: str
    torch_version: str
    options: str  # the engine options that change a decode step, as JSON

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:KEY_DIGITS]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_DIGITS]


def model_fingerprint(config: EngineConfig) -> str:
    """The model as the decode step sees it: shapes and number formats, not weight values."""
    from transformers import PretrainedConfig

    model = config.model
    hf_config = model.hf_config
    if isinstance(hf_config, PretrainedConfig):
        described = hf_config.to_json_string(use_diff=False)
    else:
        described = repr(hf_config)
    parts = (model.architecture, str(model.dtype), model.quantization.value, repr(model.mla_forms), described)
    return _sha("|".join(parts))


def decode_options(config: EngineConfig) -> str:
    """The options that change what a decode step runs or how fast, as sorted JSON."""
    parallel, cache, scheduler = config.parallel, config.cache, config.scheduler
    connector = config.connector
    options = {
        "device": config.device,
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "executor": parallel.executor.value,
        "moe_parallel": parallel.moe_parallel.value,
        "cpu_cores": list(parallel.cpu_cores) if parallel.cpu_cores else None,
        "cpu_threads": parallel.cpu_threads,
        "block_size": cache.block_size,
        "layout": cache.layout.value,
        "kv_allocator": cache.kv_allocator.value,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "connector": connector.connector_class.__qualname__ if connector is not None else None,
        "kv_role": config.kv_transfer.kv_role.value if connector is not None else None,
    }
    return json.dumps(options, sort_keys=True)


def capture_cache_key(config: EngineConfig) -> CaptureCacheKey:
    return CaptureCacheKey(
        model=model_fingerprint(config),
        cpu=_sha(" ".join(sorted(read_cpu_features().flags))),
        cores=len(os.sched_getaffinity(0)),
        kvferry_version=metadata.version("kvferry"),
        torch_version=torch.__version__,
        options=decode_options(config),
    )


class CaptureCache:
    """The stored decisions under one cache directory."""

    def __init__(self, root: Path):
        self.dir = root / "capture"

    def path(self, key: CaptureCacheKey) -> Path:
        return self.dir / f"{key.digest()}.json"

    def load(self, key: CaptureCacheKey) -> CaptureDecision | None:
        """The decision stored for `key`, marked as cached; None when there is none or the
        file cannot be read (the start then measures and rewrites it)."""
        path = self.path(key)
        try:
            stored = json.loads(path.read_text())
            timings = tuple(StepTiming(**t) for t in stored["timings"])
            mode = CaptureMode(stored["mode"])
            decision = CaptureDecision(mode, bool(stored["compiled"]), timings, cached=True)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as err:
            logger.warning("ignoring the unreadable capture decision %s: %s", path, err)
            return None
        return decision

    def store(self, key: CaptureCacheKey, decision: CaptureDecision) -> None:
        """Keep a measured decision (atomically); a failure only costs the next start time."""
        record = {
            "key": asdict(key),
            "mode": decision.mode.value,
            "compiled": decision.compiled,
            "timings": [asdict(t) for t in decision.timings],
        }
        try:
            write_json_atomically(self.path(key), record)
        except OSError as err:
            logger.warning("could not keep the capture decision in %s: %s", self.dir, err)


def cache_for(config: EngineConfig) -> tuple[CaptureCache, CaptureCacheKey] | None:
    """The decision cache and this engine's key, when --capture auto decides and a cache
    directory is configured."""
    compilation = config.compilation
    if compilation.capture is not CaptureMode.AUTO or compilation.cache_dir is None:
        return None
    return CaptureCache(Path(compilation.cache_dir)), capture_cache_key(config)
