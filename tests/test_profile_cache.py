"""The profiling step's activation peak kept across starts (kvferry/engine/profile_cache.py):
a second start of the same model and options reads free memory alone, sizes the same KV
cache and answers the same; another model length, an unreadable record or no cache
directory means profiling again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvferry.engine import profile_run
from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams

PROMPTS = ["the cat sat on the", "a dog ran to"]
GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture
def profiling_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per profiling step the engines run."""
    steps: list[int] = []
    real = profile_run.run_profiling_step

    def counted(executor, config):  # noqa: ANN001, ANN202 - the real one's signature
        steps.append(1)
        return real(executor, config)

    monkeypatch.setattr(profile_run, "run_profiling_step", counted)
    return steps


def _start(model: Path, cache_dir: Path | None, max_model_len: int = 512) -> LLM:
    return LLM(
        str(model),
        dtype="float32",
        max_model_len=max_model_len,
        max_num_batched_tokens=512,
        kv_cache_bytes=4 << 20,
        enforce_eager=True,
        cache_dir=None if cache_dir is None else str(cache_dir),
    )


def _answer_and_stop(llm: LLM) -> tuple[int, int, list[list[int]]]:
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        blocks = llm.engine.scheduler.kv_cache_manager.num_blocks
        return (
            llm.engine.kv_budget.activation_peak_bytes,
            blocks,
            [list(o.outputs[0].token_ids) for o in outs],
        )
    finally:
        llm.engine.shutdown()


def test_a_second_start_recalls_the_peak_and_skips_the_profiling_step(
    tiny_llama: Path, tmp_path: Path, profiling_steps: list[int]
) -> None:
    first = _answer_and_stop(_start(tiny_llama, tmp_path))
    assert len(profiling_steps) == 1 and first[0] > 0
    (record,) = (tmp_path / "memory-profile").glob("*.json")
    assert json.loads(record.read_text())["activation_peak_bytes"] == first[0]
    assert _answer_and_stop(_start(tiny_llama, tmp_path)) == first  # same peak, blocks, tokens
    assert len(profiling_steps) == 1
    _answer_and_stop(_start(tiny_llama, tmp_path, max_model_len=256))  # other prompts: measured
    assert len(profiling_steps) == 2 and len(list((tmp_path / "memory-profile").glob("*.json"))) == 2


def test_an_unreadable_record_or_no_cache_directory_means_profiling(
    tiny_llama: Path, tmp_path: Path, profiling_steps: list[int]
) -> None:
    _answer_and_stop(_start(tiny_llama, tmp_path))
    (record,) = (tmp_path / "memory-profile").glob("*.json")
    record.write_text("{not json")
    peak, _, _ = _answer_and_stop(_start(tiny_llama, tmp_path))
    assert len(profiling_steps) == 2
    assert json.loads(record.read_text())["activation_peak_bytes"] == peak  # rewritten
    _answer_and_stop(_start(tiny_llama, None))
    _answer_and_stop(_start(tiny_llama, None))
    assert len(profiling_steps) == 4


def test_tensor_parallel_ranks_report_their_free_memory_on_a_recalled_start(
    tiny_llama: Path, tmp_path: Path, profiling_steps: list[int]
) -> None:
    """TP=2 (a rank process each): the second start asks every rank for its free memory
    (a method the ranks must answer) instead of profiling, and answers the same."""

    def start() -> LLM:
        return LLM(
            str(tiny_llama),
            dtype="float32",
            max_model_len=256,
            max_num_batched_tokens=256,
            kv_cache_bytes=2 << 20,
            enforce_eager=True,
            tensor_parallel_size=2,
            cache_dir=str(tmp_path),
        )

    first = _answer_and_stop(start())
    assert _answer_and_stop(start()) == first
    assert len(profiling_steps) == 1
