"""Start-up: --capture auto's decision is kept across starts (kvferry.engine.capture_cache),
so a start never compiles a program it throws away. Compiles are counted by torch's own
counter of the graphs it compiled, so a compile anywhere in the engine fails a test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch._dynamo.utils as dynamo_utils

from kvferry.config import CaptureMode, EngineOptions
from kvferry.engine import capture_choice
from kvferry.engine.capture_cache import CaptureCache, capture_cache_key
from kvferry.engine.options import engine_config
from kvferry.engine.startup_report import StartupClock, StartupPhase
from kvferry.sampling_params import SamplingParams
from kvferry.worker.capture import CaptureDecision, CaptureStats, StepTiming
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, engine_config_of, make_llm, tokenize_all

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _graphs_compiled() -> int:
    return int(dynamo_utils.counters["stats"]["unique_graphs"])


def _stats(llm) -> CaptureStats:
    (stats,) = llm.engine.executor.capture_stats()
    return stats


def _tokens(llm, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def _options(model: Path, cache_dir: Path, **changes: object) -> EngineOptions:
    given: dict[str, object] = {
        "dtype": "float32",
        "max_model_len": 512,
        "cache_dir": str(cache_dir),
        **changes,
    }
    return EngineOptions(str(model), **given)  # type: ignore[arg-type]


def test_the_key_changes_with_the_model_and_the_options(
    tiny_llama: Path, tiny_qwen2: Path, tmp_path: Path
) -> None:
    base = capture_cache_key(engine_config(_options(tiny_llama, tmp_path)))
    assert capture_cache_key(engine_config(_options(tiny_llama, tmp_path))) == base
    assert capture_cache_key(engine_config(_options(tiny_llama, tmp_path / "elsewhere"))) == base
    changed = {
        "model": _options(tiny_qwen2, tmp_path),
        "dtype": _options(tiny_llama, tmp_path, dtype="bfloat16"),
        "max_num_seqs": _options(tiny_llama, tmp_path, max_num_seqs=4),
        "block_size": _options(tiny_llama, tmp_path, block_size=32),
        "cpu_threads": _options(tiny_llama, tmp_path, cpu_threads=1),
        "kv_layout": _options(tiny_llama, tmp_path, kv_layout="HND"),
    }
    digests = {name: capture_cache_key(engine_config(o)).digest() for name, o in changed.items()}
    assert base.digest() not in digests.values()
    assert len(set(digests.values())) == len(digests), digests


# The tests of --capture auto's decision use the tiny Qwen3: its layers (per-head q/k norms)
# take no fused decode layer, so auto measures a compiled program (a model whose every layer
# decodes fused compiles nothing: tests/test_fused_decode.py).


def test_a_cached_eager_decision_compiles_nothing(tiny_qwen3: Path, tmp_path: Path) -> None:
    """An earlier start measured eager faster: this start follows it before warm-up, so no
    graph is compiled (warm-up, decision, and the decode steps of real requests alike), no
    step is timed, and the tokens are eager's."""
    prompts = tokenize_all(tiny_qwen3, PROMPT_TEXTS[:3])
    expected = _tokens(make_llm(tiny_qwen3, enforce_eager=True), prompts)
    measured = CaptureDecision(CaptureMode.AUTO, False, (StepTiming(1, 0.02, 0.01),))
    store_decision_for(tiny_qwen3, tmp_path, measured)
    before = _graphs_compiled()
    llm = make_llm(tiny_qwen3, capture=CaptureMode.AUTO, cache_dir=tmp_path)
    assert llm.engine.capture_decision == CaptureDecision(
        CaptureMode.AUTO, False, measured.timings, cached=True
    )
    assert _tokens(llm, prompts) == expected
    assert _graphs_compiled() == before, "a start with a cached eager decision compiled a graph"
    assert _stats(llm).compiled_steps == 0 and _stats(llm).compile_seconds == 0.0
    assert_pool_full(llm)
    report = llm.engine.startup
    assert [phase for phase, _ in report.phases] == list(StartupPhase)[1:]
    assert report.compile_s == 0.0 and report.before_engine_s is not None
    assert report.describe().startswith(f"start-up {report.total_s:.1f}s: imports, config, tokenizer ")
    assert report.describe().endswith(
        "; captured forward: off (cached decision, measured by an earlier start: "
        "decode step 20.0 vs 10.0 ms eager at batch 1)"
    )


def store_decision_for(model: Path, cache_dir: Path, decision: CaptureDecision) -> None:
    """Store `decision` under the key of make_llm(model, capture=AUTO, cache_dir=cache_dir)."""
    key = capture_cache_key(engine_config_of(model, capture=CaptureMode.AUTO, cache_dir=cache_dir))
    CaptureCache(cache_dir).store(key, decision)


@pytest.mark.slow  # compiles a forward
def test_the_first_start_measures_and_the_next_follows_its_decision(
    tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = make_llm(tiny_qwen3, capture=CaptureMode.AUTO, cache_dir=tmp_path)
    decision = first.engine.capture_decision
    assert decision.timings and not decision.cached
    (stored,) = (tmp_path / "capture").glob("*.json")
    assert json.loads(stored.read_text())["compiled"] is decision.compiled
    del first

    def no_measuring(*args: object) -> StepTiming:
        raise AssertionError("a start with a cached decision measured again")

    monkeypatch.setattr(capture_choice, "measure", no_measuring)
    before = _graphs_compiled()
    second = make_llm(tiny_qwen3, capture=CaptureMode.AUTO, cache_dir=tmp_path)
    assert second.engine.capture_decision == CaptureDecision(
        CaptureMode.AUTO, decision.compiled, decision.timings, cached=True
    )
    prompts = tokenize_all(tiny_qwen3, PROMPT_TEXTS[:2])
    assert _tokens(second, prompts) == _tokens(make_llm(tiny_qwen3, enforce_eager=True), prompts)
    compiled_graphs = _graphs_compiled() - before
    assert (compiled_graphs > 0) is decision.compiled
    assert (_stats(second).compiled_steps > 0) is decision.compiled


def test_the_answer_time_is_read_on_the_start_up_clock() -> None:
    """An answer a few milliseconds after start-up is never timed before start-up ended: the
    kernel's record of the process start counts whole ticks, so the answer time continues the
    start-up total on the same clock instead of reading that record again."""
    clock = StartupClock(before_engine_s=1.0)
    for phase in list(StartupPhase)[1:]:
        clock.lap(phase)
    report = clock.report(compile_s=0.0, decision="eager")
    first, second = report.process_age_s(), report.process_age_s()
    assert first is not None and second is not None
    assert report.total_s <= first <= second < report.total_s + 1.0
    assert StartupClock(before_engine_s=None).report(0.0, "eager").process_age_s() is None
