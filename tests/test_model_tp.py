"""Tensor parallelism for real: two gloo ranks in two processes against one process."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from kvferry.model.loader import load_model
from kvferry.model.resolve import resolve_model_config
from tests.fixtures.tp_worker import run_rank, run_steps

PROMPTS = [[5, 9, 13, 200, 31, 77, 8], [40, 41, 42]]


def test_tp2_matches_tp1(tiny_llama: Path, tiny_qwen2: Path, tiny_qwen3: Path, tmp_path: Path) -> None:
    model_dirs = {"llama": str(tiny_llama), "qwen2": str(tiny_qwen2), "qwen3": str(tiny_qwen3)}
    args = (2, str(tmp_path / "init"), model_dirs, str(tmp_path), PROMPTS)
    mp.start_processes(run_rank, args=args, nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for arch, model_dir in model_dirs.items():
        expected = run_steps(load_model(resolve_model_config(model_dir)), PROMPTS)
        for out in ranks:
            for step, logits in expected.items():
                for req, value in logits.items():
                    torch.testing.assert_close(out[arch][step][req], value, atol=1e-4, rtol=0)
