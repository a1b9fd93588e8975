"""Resident KV memory over time for a bursty two-model workload: eager engines splitting a
budget in halves vs elastic engines sharing it as one pool (docs/benchmarks.md).

Run from the repository root: `PYTHONPATH=. .venv/bin/python docs/scripts/elastic_bursty.py`.
Writes bench-results/elastic_bursty.{json,png}.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from kvferry.config import CacheConfig, CompilationConfig, EngineConfig, SchedulerConfig
from kvferry.engine.llm import LLM
from kvferry.kv.shared_pool import KVPoolSpec
from kvferry.model.resolve import resolve_model_config
from kvferry.sampling_params import SamplingParams
from tests.fixtures.tiny_models import build_tiny_model

POOL_BYTES = 4 << 20  # what the two engines share (elastic) or split in halves (eager)
PROMPTS = [f"the cat {i} sees a dog and the red ball in the morning " * 4 for i in range(24)]
PARAMS = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
OUT = Path("bench-results")


def tiny(arch: str) -> Path:
    path = Path(f"/tmp/kvferry-bench-tiny-{arch}")
    if not path.exists():
        build_tiny_model(arch, path)
    return path


def engine(model: Path, allocator: str, cache_bytes: int | None, pool: KVPoolSpec | None) -> LLM:
    config = EngineConfig(
        model=resolve_model_config(str(model), dtype="float32", max_model_len=512),
        cache=CacheConfig(kv_cache_bytes=cache_bytes, kv_allocator=allocator, kv_memory_pool=pool),
        scheduler=SchedulerConfig(512, 64, True),
        compilation=CompilationConfig(enforce_eager=True),
    )
    return LLM.from_config(config)


def run(engines: list[LLM]) -> list[tuple[int, int]]:
    """Four bursts taking turns; both engines' resident KV bytes after every step."""
    trace = []
    for burst in range(4):
        active = engines[burst % 2]
        for index, prompt in enumerate(PROMPTS):
            active.engine.add_request(active.inputs.process(f"{burst}-{index}", prompt, PARAMS))
        while any(e.engine.has_unfinished_requests() for e in engines):
            for e in engines:
                if e.engine.has_unfinished_requests():
                    e.engine.step()
            trace.append(tuple(e.engine.executor.kv_memory_usage()[0].resident_bytes for e in engines))
    return trace


def main() -> None:
    models = [tiny("llama"), tiny("qwen2")]
    pool = KVPoolSpec(f"bench-{uuid.uuid4().hex[:8]}", POOL_BYTES)
    setups = {
        "eager": [engine(m, "eager", POOL_BYTES // 2, None) for m in models],
        "elastic": [engine(m, "elastic", None, pool) for m in models],
    }
    results = {}
    for mode, engines in setups.items():
        totals = [sum(step) for step in run(engines)]
        results[mode] = {
            "peak_mib": max(totals) / 2**20,
            "mean_mib": sum(totals) / len(totals) / 2**20,
            "steps": len(totals),
            "preemptions": [e.stats().num_preemptions for e in engines],
            "resident_bytes": totals,
        }
        print(mode, {k: v for k, v in results[mode].items() if k != "resident_bytes"})
    pool.path.unlink(missing_ok=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "elastic_bursty.json").write_text(json.dumps(results))
    matplotlib.use("Agg")
    fig, ax = plt.subplots(figsize=(8, 4))
    for mode, result in results.items():
        ax.plot([b / 2**20 for b in result["resident_bytes"]], label=f"{mode} (both engines)")
    ax.set_xlabel("step")
    ax.set_ylabel("resident KV MiB")
    ax.set_title("two tiny models, bursts taking turns")
    ax.legend()
    fig.savefig(OUT / "elastic_bursty.png", dpi=100)


if __name__ == "__main__":
    main()
