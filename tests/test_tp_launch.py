"""LLM(model, tensor_parallel_size=2) from wherever a user writes it: a script without a
`__main__` guard and `python -c`. Rank processes are their own programs
(kvferry.executor.rank_process, started with subprocess), so neither re-runs the caller's
code; code read from stdin (a REPL) has no `__main__.__file__` either and starts ranks the
same way as `-c`. Outputs equal TP=1's, computed in this process with the same options.
Each run exits on its own."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.executor.rank import WorkerCall

# slow: TP=2 engines launched from a script and from -c (make test-all only)
pytestmark = pytest.mark.slow

OPTIONS = 'dtype="float32", kv_cache_bytes=1 << 24, max_model_len=256, enforce_eager=True'
PROMPTS = '["the cat", "a dog sees the red ball"]'
CODE = f"""
import json, sys
from kvferry import LLM, SamplingParams
llm = LLM({{model!r}}, tensor_parallel_size={{tp}}, {OPTIONS})
outs = llm.generate({PROMPTS}, SamplingParams(max_tokens=8, temperature=0.0))
print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
"""


def _tokens(stdout: str) -> list[list[int]]:
    lines = [line for line in stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1, stdout  # printed once: the caller's code ran once, in the caller
    return json.loads(lines[0][len("TOKENS ") :])


def _run(argv: list[str]) -> list[list[int]]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _tokens(done.stdout)


@pytest.fixture(scope="module")
def single_rank(tiny_llama: Path) -> list[list[int]]:
    """CODE's tokens at TP=1, run in this process (an in-process engine, no rank process)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(CODE.format(model=str(tiny_llama), tp=1), {})  # the very code the TP=2 runs run
    return _tokens(printed.getvalue())


def test_tp2_from_a_script_without_a_main_guard(tiny_llama: Path, tmp_path: Path, single_rank) -> None:
    script = tmp_path / "plain_script.py"
    script.write_text(CODE.format(model=str(tiny_llama), tp=2))
    assert _run([sys.executable, str(script)]) == single_rank


def test_tp2_from_python_c(tiny_llama: Path, single_rank) -> None:
    assert _run([sys.executable, "-c", CODE.format(model=str(tiny_llama), tp=2)]) == single_rank


def test_a_rank_runs_only_worker_methods() -> None:
    with pytest.raises(ValueError, match="not a method a rank answers"):
        WorkerCall(print, ("hello",))
