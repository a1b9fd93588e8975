"""The captured forward (kvferry.worker.capture): decode steps run compiled, with every
connector hook still called, and the same greedy tokens as the eager forward. Tests that
assert the compiled path ran force --capture always (auto measures, and a noisy host could
decide eager); auto's decision is tested with a timer that makes one forward win."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvferry.config import CaptureMode, CompilationConfig, KVTransferConfig, SchedulerConfig
from kvferry.connector.base import KVConnectorBase
from kvferry.connector.recording import RecordingConnector
from kvferry.engine import capture_choice
from kvferry.entrypoints import cli
from kvferry.entrypoints.cli import build_parser
from kvferry.entrypoints.engine_args import engine_config_from_args
from kvferry.errors import ConfigError
from kvferry.model.forward_context import HookPlacement
from kvferry.sampling_params import SamplingParams
from kvferry.worker.capture import CapturedForward, CaptureStats, StepTiming, cuda_graph_size, hook_placement
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm, tokenize_all
from tests.fixtures.tiny_models import ARCHS
from tests.tiers import SLOW

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ALWAYS = CaptureMode.ALWAYS


def _tokens(llm, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _stats(llm) -> CaptureStats:
    (stats,) = llm.engine.executor.capture_stats()
    return stats


def _traces() -> Counter[str]:
    """How often the compiler traced a frame, per attempt: `compile_attempt_1` counts the
    traces it had to start again."""
    timings = torch._dynamo.utils.compilation_time_metrics
    return Counter({name: len(runs) for name, runs in timings.items() if name.startswith("compile_attempt_")})


# The fast tier compiles one model (the tiny llama, a batch of 3); make test-all each batch
# size on the llama and each architecture at a batch of 3 (the compiled program is one for
# every batch size, and the padding of a batch of one is the same code for each model).
ARCH_BATCHES = [
    pytest.param(arch, batch, id=f"{arch}-{batch}", marks=() if (arch, batch) == ("llama", 3) else SLOW)
    for arch in ARCHS
    for batch in ((1, 3, 10) if arch == "llama" else (3,))
]


@pytest.mark.parametrize(("tiny_model", "batch"), ARCH_BATCHES, indirect=["tiny_model"])
def test_captured_greedy_equals_eager(tiny_model: Path, batch: int) -> None:
    """Batches of 1 (padded to 2), 3 and 10 decodes; prompts of different lengths."""
    prompts = tokenize_all(tiny_model, PROMPT_TEXTS[:batch])
    eager = _tokens(make_llm(tiny_model, enforce_eager=True), prompts)
    traces = _traces()
    llm = make_llm(tiny_model, capture=ALWAYS)
    # The model was traced once, its floats read as constants (kvferry.worker.capture.floats_specialized).
    assert _traces() - traces == Counter(compile_attempt_0=1)
    before = _stats(llm).compiled_steps
    assert _tokens(llm, prompts) == eager
    stats = _stats(llm)
    assert stats.compiled_steps - before == GREEDY.max_tokens - 1  # every decode step ran compiled
    assert_pool_full(llm)


def test_enforce_eager_compiles_nothing(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, enforce_eager=True)
    _tokens(llm, tokenize_all(tiny_llama, PROMPT_TEXTS[:2]))
    assert _stats(llm).compiled_steps == 0 and _stats(llm).eager_steps > 0


def test_an_eager_engine_never_imports_the_compiler(tiny_llama: Path, tmp_path: Path) -> None:
    """Importing torch's compiler takes seconds: a process that imports the server and runs
    an --enforce-eager engine whose connector's hooks split graphs never imports it."""
    transfer = (
        "KVTransferConfig('SplitRecordingConnector', kv_connector_module_path='tests.test_capture', "
        f"kv_connector_extra_config={{'record_path': {str(tmp_path / 'hooks.jsonl')!r}}})"
    )
    code = (
        "import sys\nfrom kvferry.entrypoints.openai import server\nfrom kvferry.engine.llm import LLM\n"
        "from kvferry.config import KVTransferConfig\n"
        f"llm = LLM({str(tiny_llama)!r}, enforce_eager=True, kv_cache_bytes=8 << 20, kv_transfer={transfer})\n"
        "print(llm.generate(['the cat'])[0].outputs[0].token_ids, 'torch._dynamo' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("False"), done.stdout
    assert (tmp_path / "hooks.jsonl").read_text(), "the split hooks never ran"


@pytest.mark.slow  # compiles a forward
def test_captured_equals_eager_with_chunked_prefill_and_preemption(tiny_llama: Path) -> None:
    """A 24-token budget chunks prompts into mixed prefill/decode steps (eager) between
    decode-only steps (compiled); 24 blocks of 4 tokens force preemptions."""
    prompts = tokenize_all(tiny_llama, PROMPT_TEXTS)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    kwargs = {"budget": 24, "block_size": 4, "num_blocks": 24, "max_num_seqs": 8}
    eager_llm = make_llm(tiny_llama, enforce_eager=True, **kwargs)
    eager = _tokens(eager_llm, prompts, params)
    llm = make_llm(tiny_llama, capture=ALWAYS, **kwargs)
    assert _tokens(llm, prompts, params) == eager
    assert llm.stats().num_preemptions > 0 and eager_llm.stats().num_preemptions > 0
    assert _stats(llm).compiled_steps > 0
    assert_pool_full(llm)


@pytest.mark.slow  # compiles a forward
def test_captured_sampling_and_logprobs_match_eager(tiny_qwen2: Path) -> None:
    """Seeded sampling, penalties and logprobs through the compiled decode steps."""
    prompts = tokenize_all(tiny_qwen2, PROMPT_TEXTS[:6])
    params = SamplingParams(
        max_tokens=8, temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5, logprobs=3, ignore_eos=True
    )
    requests = [{"prompt_token_ids": p} for p in prompts]
    eager = make_llm(tiny_qwen2, enforce_eager=True).generate(requests, params)
    captured = make_llm(tiny_qwen2, capture=ALWAYS).generate(requests, params)
    for a, b in zip(eager, captured, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.sampled == pytest.approx(lb.sampled, abs=1e-4)
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
            assert [p for _, p in la.top] == pytest.approx([p for _, p in lb.top], abs=1e-4)


@pytest.mark.slow  # TP=2 ranks, each compiling
def test_tensor_parallel_captured_equals_eager(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP=2 (one process per rank): the all-reduces run inside each rank's compiled graph;
    --capture auto's decision (compiled made to win) is the engine's, the same on both ranks.
    The reference is one eager rank (test_tp: eager TP=2 equals it on these prompts)."""
    prompts = tokenize_all(tiny_llama, PROMPT_TEXTS[:4])
    eager = _tokens(make_llm(tiny_llama, enforce_eager=True), prompts)
    _make_win(monkeypatch, compiled=True)
    llm = make_llm(tiny_llama, tp=2, capture=CaptureMode.AUTO)
    try:
        assert _tokens(llm, prompts) == eager
        ranks = llm.engine.executor.capture_stats()
        assert len(ranks) == 2 and all(r.compiled_steps >= GREEDY.max_tokens - 1 for r in ranks)
        assert ranks[0].decision == ranks[1].decision == llm.engine.capture_decision
        assert ranks[0].decision.compiled and ranks[0].decision.timings
    finally:
        llm.engine.shutdown()


def _make_win(monkeypatch: pytest.MonkeyPatch, compiled: bool) -> None:
    """Each timed dummy step still runs; it reads 1 s for the winning forward, 2 s for the other."""
    real = capture_choice.time_step

    def timed(run: capture_choice.RunStep, step: object, is_compiled: bool) -> float:
        real(run, step, is_compiled)
        return 1.0 if is_compiled is compiled else 2.0

    monkeypatch.setattr(capture_choice, "time_step", timed)


@pytest.mark.slow  # compiles a forward
@pytest.mark.parametrize("compiled_wins", [True, False], ids=["compiled-wins", "eager-wins"])
def test_auto_keeps_the_faster_forward_and_logs_both_numbers(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, compiled_wins: bool
) -> None:
    """The default (--capture auto) times dummy decode steps at batch 1 and min(max_num_seqs,
    32) and keeps the faster forward; either way the greedy tokens are eager's, batch of 1
    (padded when compiled) included."""
    prompts = tokenize_all(tiny_qwen3, PROMPT_TEXTS[:3])
    eager = [_tokens(make_llm(tiny_qwen3, enforce_eager=True), p) for p in (prompts[:1], prompts)]
    _make_win(monkeypatch, compiled=compiled_wins)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=capture_choice.__name__):
        llm = make_llm(tiny_qwen3, max_num_seqs=8, capture=CaptureMode.AUTO)
    decision = _stats(llm).decision
    assert decision == llm.engine.capture_decision and decision.mode is CaptureMode.AUTO
    assert decision.compiled is compiled_wins
    fast, slow = (1.0, 2.0) if compiled_wins else (2.0, 1.0)
    assert decision.timings == (StepTiming(1, fast, slow), StepTiming(8, fast, slow))
    state = "on" if compiled_wins else "off"
    expected = (
        f"captured forward: {state} (decode step {fast * 1e3:.1f} vs {slow * 1e3:.1f} ms eager at batch 1; "
        f"decode step {fast * 1e3:.1f} vs {slow * 1e3:.1f} ms eager at batch 8)"
    )
    assert [r.getMessage() for r in caplog.records if r.name == capture_choice.__name__] == [expected]
    before = _stats(llm).compiled_steps
    assert [_tokens(llm, p) for p in (prompts[:1], prompts)] == eager
    decodes = 2 * (GREEDY.max_tokens - 1)
    assert _stats(llm).compiled_steps - before == (decodes if compiled_wins else 0)
    assert_pool_full(llm)


def test_timed_batch_sizes_fit_the_limits_and_the_cache() -> None:
    """1 and min(max_num_seqs, 32, the token budget, what the cache holds); none if nothing fits."""

    def sizes(num_blocks: int, block_size: int, max_num_seqs: int) -> list[int]:
        kv = SimpleNamespace(num_blocks=num_blocks, block_size=block_size, has_sliding_window=False)
        config = SimpleNamespace(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))
        return capture_choice.timed_batch_sizes(config, kv)  # type: ignore[arg-type]

    assert sizes(4096, 16, 128) == [1, 32]
    assert sizes(24, 4, 8) == [1, 8]  # 3 blocks of 4 tokens per dummy request
    assert sizes(10, 16, 64) == [1, 10]
    assert sizes(40, 16, 1) == [1]
    assert sizes(2, 4, 8) == []
    timings = (StepTiming(1, 1.2, 1.0), StepTiming(32, 0.7, 1.0))
    assert capture_choice.keeps_compiled(timings)  # 20% slower at 1, 30% faster at 32: faster overall
    assert not capture_choice.keeps_compiled(timings[:1])


def test_capture_mode_flags_and_their_vllm_names(tiny_qwen3: Path) -> None:
    def mode(*flags: str) -> CaptureMode:
        args = build_parser().parse_args(["serve", str(tiny_qwen3), *flags])
        return engine_config_from_args(args).compilation.capture

    assert mode() is CaptureMode.AUTO
    assert mode("--capture", "always") is CaptureMode.ALWAYS
    assert mode("--enforce-eager") is mode("--capture", "never") is CaptureMode.NEVER
    assert CompilationConfig(enforce_eager=True).capture is CaptureMode.NEVER
    assert CompilationConfig(capture="never").enforce_eager  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="contradicts"):
        CompilationConfig(capture=CaptureMode.ALWAYS, enforce_eager=True)


class SplitRecordingConnector(RecordingConnector):
    """The recording connector, declared not graph-safe: its hooks split the graph."""

    graph_safe = False


def _record(tmp_path: Path, model: Path, connector: str) -> tuple[list[dict], object]:
    path = tmp_path / "hooks.jsonl"
    transfer = KVTransferConfig(
        connector, kv_connector_module_path=__name__, kv_connector_extra_config={"record_path": str(path)}
    )
    # Graph breaks are counted when the forward is traced: drop code compiled by earlier
    # tests in this process (an engine with the same placement would reuse it untraced).
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    llm = make_llm(model, kv_transfer=transfer, capture=ALWAYS)
    _tokens(llm, tokenize_all(model, PROMPT_TEXTS[:3]), SamplingParams(max_tokens=4, temperature=0.0))
    assert_pool_full(llm)
    return [json.loads(line) for line in path.read_text().splitlines()], llm


def _decode_steps_saw_every_layer(records: list[dict], num_layers: int) -> int:
    """Per worker step (from its bind): the layer hooks carry that step's own counter, once
    per layer each; returns how many single-token-per-request (decode) steps there were."""
    steps: dict[int, list[dict]] = {}
    for rec in records:
        if rec["role"] == "worker" and "step" in rec:
            steps.setdefault(rec["step"], []).append(rec)
    decodes = 0
    for step, recs in steps.items():
        waits = [r["layer"] for r in recs if r["hook"] == "wait_for_layer_load"]
        saves = [r for r in recs if r["hook"] == "save_kv_layer"]
        if not saves:
            continue  # an empty step: no forward
        assert len(waits) == len(saves) == num_layers, f"step {step}"
        assert waits == [r["layer"] for r in saves]  # in layer order, each wait before its save
        decodes += saves[0]["tokens"] <= 3  # a decode step: at most one token per prompt
    return decodes


@pytest.mark.slow  # compiles a forward
@pytest.mark.parametrize(
    ("connector", "placement"),
    [("RecordingConnector", HookPlacement.IN_GRAPH), ("SplitRecordingConnector", HookPlacement.SPLIT)],
)
def test_connector_hooks_run_inside_the_captured_forward(
    tmp_path: Path, tiny_llama: Path, connector: str, placement: HookPlacement
) -> None:
    """Graph-safe: the hooks are operators of one full graph (no graph break); not
    graph-safe: the graph is split at each hook. Either way every replayed decode step
    calls both hooks for every layer with its own bound metadata."""
    records, llm = _record(tmp_path, tiny_llama, connector)
    runner = llm.engine.executor.worker.runner
    assert runner.forward.placement is placement
    assert _decode_steps_saw_every_layer(records, llm.config.model.num_layers) >= 3
    assert _stats(llm).compiled_steps >= 3
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    if placement is HookPlacement.IN_GRAPH:
        assert breaks == 0
    else:
        assert breaks > 0  # the compiled forward really was cut at the hooks


def test_placement_follows_the_connector_declarations() -> None:
    class NoLayerHooks(RecordingConnector):
        has_layer_hooks = False

    class Overrides(KVConnectorBase):
        def save_kv_layer(self, layer_name, kv_layer, attn):  # noqa: ANN001
            pass

    def placed(cls: type) -> HookPlacement:
        return hook_placement(cls.__new__(cls))

    assert placed(RecordingConnector) is HookPlacement.IN_GRAPH
    assert placed(SplitRecordingConnector) is HookPlacement.SPLIT
    assert placed(NoLayerHooks) is HookPlacement.NONE
    assert placed(Overrides) is HookPlacement.SPLIT  # undeclared: overriding a hook counts
    assert hook_placement(None) is HookPlacement.NONE


def _generate_args(model: Path, *extra: str) -> list[str]:
    args = ["generate", str(model), "the cat sees", "--raw", "--max-tokens", "8", "--max-model-len", "256"]
    return [*args, "--kv-cache-memory", "0.0625", *extra]


@pytest.mark.slow  # an engine in a subprocess, compiling
def test_a_missing_compiler_falls_back_to_eager_with_one_warning(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No C++ compiler for inductor: the engine starts, warns once naming the cause, and
    answers exactly as --enforce-eager does (the same command, run in this process)."""
    cli.main(_generate_args(tiny_llama, "--enforce-eager"))
    eager = capsys.readouterr().out
    # --capture auto: `generate` alone decodes eagerly (cli.generate_capture) and compiles nothing
    cmd = [sys.executable, "-m", "kvferry.entrypoints.cli", *_generate_args(tiny_llama, "--capture", "auto")]
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    env = {**os.environ, **cache, "CXX": "/nonexistent/g++"}
    broken = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert broken.returncode == 0, broken.stderr
    warnings = [line for line in broken.stderr.splitlines() if "captured forward unavailable" in line]
    assert len(warnings) == 1 and "g++" in warnings[0], broken.stderr[-2000:]
    assert broken.stdout == eager and eager.strip()


def test_cuda_graph_sizes_are_powers_of_two() -> None:
    assert [cuda_graph_size(n) for n in (1, 2, 3, 5, 8, 9, 64, 65)] == [2, 2, 4, 8, 8, 16, 64, 128]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_greedy_equals_eager(tiny_llama: Path) -> None:
    prompts = tokenize_all(tiny_llama, PROMPT_TEXTS[:5])
    eager = _tokens(make_llm(tiny_llama, enforce_eager=True, device="cuda"), prompts)
    llm = make_llm(tiny_llama, device="cuda", capture=ALWAYS)
    assert _tokens(llm, prompts) == eager
    assert _stats(llm).compiled_steps >= GREEDY.max_tokens - 1


class _Stack(torch.nn.Module):
    """A model whose structure (its layer count) differs per instance, as models do."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.slow  # compiles a forward
def test_each_engine_compiles_its_own_program_past_the_recompile_limit() -> None:
    """A process that builds engines for more differently shaped models than the compiler's
    recompile limit still gets a full graph for each (it had run them eagerly after 8)."""
    limit = torch._dynamo.config.recompile_limit
    x = torch.randn(3, 4)
    for num_layers in range(1, limit + 3):
        model = SimpleNamespace(model=_Stack(num_layers))
        program = CapturedForward._compile(model, HookPlacement.NONE, cuda_graphs=False)
        torch.testing.assert_close(program(x), model.model(x))
    shared = [torch.compile(_Stack(n), fullgraph=True, dynamic=True) for n in range(1, limit + 2)]
    with pytest.raises(Exception, match="fullgraph"):  # one code object for all: the limit
        for program in shared:
            program(x)


class _Doubling(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.double = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y * 2 if self.double else y


@pytest.mark.slow  # compiles a forward
def test_the_cpu_program_runs_without_checking_the_model_modules() -> None:
    """The compiled program checks its inputs, not the modules' state, before each call
    (kvferry never changes a module after the first compile): a flag flipped afterwards
    is not seen, where a checked program would have been traced again and doubled."""
    model = SimpleNamespace(model=_Doubling())
    program = CapturedForward._compile(model, HookPlacement.NONE, cuda_graphs=False)
    x = torch.randn(3, 4)
    torch.testing.assert_close(program(x), model.model.linear(x))
    model.model.double = True
    torch.testing.assert_close(program(x), model.model.linear(x))  # the program traced first
    assert program(torch.randn(5, 4)).shape == (5, 4)  # the token count still varies
