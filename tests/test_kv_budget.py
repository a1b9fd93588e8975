"""The KV budget: sizes with units, the plan from measured memory, and the profiling run."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest
import torch

from kvferry.config import EngineConfig
from kvferry.engine.llm import LLM
from kvferry.engine.profile_run import profile_num_blocks, profile_prompt_lengths
from kvferry.entrypoints.cli import main
from kvferry.errors import ConfigError
from kvferry.kv.budget import GIB, BudgetSource, MemorySize, format_bytes, parse_memory_size, plan_kv_budget
from kvferry.worker import worker as worker_module
from kvferry.worker.memory_profile import MemoryProbe
from tests.engine_helpers import PROMPT_TEXTS, make_llm

MIB = 1 << 20


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GiB", 2 * GIB), ("512M", 512 * MIB), ("1.5", 3 * GIB // 2), ("4000MB", 4 * 10**9), ("64k", 65536)],
)
def test_memory_sizes_with_units(text: str, size: int) -> None:
    assert parse_memory_size(text) == size


@pytest.mark.parametrize("text", ["", "x", "-1G", "2XB", "0", "1e9"])
def test_unreadable_memory_sizes_are_refused(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_memory_size(text)


def test_a_memory_size_is_passed_on_as_written() -> None:
    """A launcher forwards str(size): a bare '0.5' must stay 0.5 GiB, not become a byte
    count that would then be read as GiB."""
    size = MemorySize("0.5")
    assert int(size) == GIB // 2
    assert MemorySize(str(size)) == size
    assert str(pickle.loads(pickle.dumps(size))) == "0.5"


def test_budget_is_a_fraction_of_the_room_or_what_was_asked() -> None:
    by_fraction = plan_kv_budget(None, 0.25, available_bytes=8 * GIB, activation_peak_bytes=GIB)
    assert (by_fraction.source, by_fraction.kv_bytes) == (BudgetSource.FRACTION, 2 * GIB)
    asked = plan_kv_budget(3 * GIB, 0.25, available_bytes=8 * GIB, activation_peak_bytes=GIB)
    assert (asked.source, asked.kv_bytes) == (BudgetSource.ASKED, 3 * GIB)
    with pytest.raises(ConfigError, match=r"asks for 9\.00 GiB.*only 8\.00 GiB.*1\.00 GiB activation"):
        plan_kv_budget(9 * GIB, 0.25, available_bytes=8 * GIB, activation_peak_bytes=GIB)


def test_profiling_prompts_fill_the_step_budget_within_the_model_length(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, budget=1200, max_model_len=512)
    config: EngineConfig = llm.config
    try:
        assert profile_prompt_lengths(config) == [511, 511, 178]
        assert profile_num_blocks([511, 511, 178], 16) == 1 + 32 + 32 + 12
    finally:
        llm.engine.shutdown()


def _engine_with_fraction(model_dir: Path, fraction: float, max_num_batched_tokens: int) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=2048,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory_fraction=fraction,
        enforce_eager=True,
        cache_dir=None,  # measured at every start: no peak recalled from an earlier one
    )


def test_the_profiling_run_sizes_the_kv_cache_from_measured_memory(tiny_llama: Path) -> None:
    llm = _engine_with_fraction(tiny_llama, 0.01, max_num_batched_tokens=2048)
    try:
        budget = llm.engine.kv_budget
        assert budget.source is BudgetSource.FRACTION
        assert budget.activation_peak_bytes > 0
        assert budget.kv_bytes == int(0.01 * budget.available_bytes)
        model = llm.engine.config.model
        block_bytes = 2 * 16 * model.num_kv_heads * model.head_dim * 4 * model.num_layers  # K+V, fp32
        assert llm.engine.scheduler.kv_cache_manager.num_blocks == budget.kv_bytes // block_bytes
        out = llm.generate(PROMPT_TEXTS[:2])
        assert all(o.outputs[0].token_ids for o in out)
    finally:
        llm.engine.shutdown()


def test_a_larger_step_budget_measures_a_larger_activation_peak(tiny_llama: Path) -> None:
    """The peak is measured, not assumed: eight 1,023-token prefills in one step take
    tens of MiB more than one 64-token prefill (measured 26-41 MiB more here)."""
    peaks = {}
    for tokens in (64, 8192):
        llm = _engine_with_fraction(tiny_llama, 0.01, max_num_batched_tokens=tokens)
        peaks[tokens] = llm.engine.kv_budget.activation_peak_bytes
        llm.engine.shutdown()
    assert peaks[8192] > peaks[64] + 16 * MIB, peaks


# `kvferry generate`'s main() in this process (about 1.5 s): loads and profiles before refusing
def test_asking_for_more_kv_than_memory_holds_stops_start_up(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # the model and the prompt: with one positional, generate takes it as the prompt (and smollm2)
    argv = ["generate", str(tiny_llama), "the cat sees", "--dtype", "float32", "--max-tokens", "2"]
    argv += ["--kv-cache-memory", "100000GiB", "--enforce-eager"]
    with caplog.at_level(logging.DEBUG), pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # no answer was generated
    assert err.startswith("kvferry: error: ") and "asks for 100000.00 GiB per rank, but only" in err
    assert "activation peak" in err and "Traceback" not in err + caplog.text


class FixedProbe(MemoryProbe):
    """Free memory and an activation peak as stated; the room left is MemoryProbe's own."""

    def __init__(self, ranks_sharing_memory: int, free: int, peak: int):
        super().__init__(ranks_sharing_memory)
        self.free, self.peak = free, peak
        self.released: int | None = None

    def start(self, released_after_bytes: int) -> None:
        self.released = released_after_bytes
        super().start(released_after_bytes)

    def free_bytes(self) -> int:
        return self.free

    def reset_peak(self) -> None:
        pass

    def peak_above_start(self) -> int:
        return self.peak


def test_the_room_for_kv_is_each_ranks_share_less_the_activation_peak() -> None:
    probe = FixedProbe(ranks_sharing_memory=2, free=8 * GIB, peak=GIB // 2)
    probe.start(released_after_bytes=2 * GIB)
    profile = probe.finish()
    assert profile.room_bytes == (8 * GIB + 2 * GIB) // 2 - GIB // 2
    assert profile.activation_peak_bytes == GIB // 2


def test_the_engine_budget_leaves_out_the_activation_peak_and_says_so(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the profiling run: available == memory free at the start (per rank, the
    provisional cache given back included) - the activation peak; the log states both."""
    probes: list[FixedProbe] = []

    def fixed_probe(device: torch.device, ranks_on_host: int) -> FixedProbe:
        probes.append(FixedProbe(ranks_on_host, free=GIB, peak=GIB // 4))
        return probes[-1]

    monkeypatch.setattr(worker_module, "memory_probe", fixed_probe)
    with caplog.at_level(logging.INFO, logger="kvferry.engine.profile_run"):
        llm = _engine_with_fraction(tiny_llama, 0.01, max_num_batched_tokens=256)
    try:
        (probe,) = probes
        assert probe.released is not None and probe.released > 0
        budget, available = llm.engine.kv_budget, GIB + probe.released - GIB // 4
        assert (budget.available_bytes, budget.activation_peak_bytes) == (available, GIB // 4)
        assert budget.kv_bytes == int(0.01 * available)
        told = f"{format_bytes(available)} available after weights and a 0.25 GiB activation peak"
        assert told in caplog.text
    finally:
        llm.engine.shutdown()
