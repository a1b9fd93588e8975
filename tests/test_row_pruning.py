"""The last layer runs what follows its attention for the sampled rows only
(`CausalLM.forward(..., keep_rows)`, a decoder that `prunes_rows`): every row's KV is still
written, the kept rows' hidden states equal the whole forward's, and a step that samples
few rows of a long prefill runs the last MLP for those rows."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvferry.model.causal_lm import CausalLM, rows_within
from kvferry.model.loader import load_model
from kvferry.model.microbatch import MicroBatcher
from kvferry.model.resolve import resolve_model_config
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import make_llm
from tests.fixtures.paged import Chunk, PagedDriver


@contextmanager
def mlp_rows(model: CausalLM) -> Iterator[list[int]]:
    """Rows given to each layer's MLP (index: layer), summed over the calls made while open
    (micro-batch parts included)."""
    layers = model.model.layers
    seen = [0] * len(layers)

    def record(index: int):
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen[index] += args[0].shape[0]

        return hook

    handles = [layer.mlp.register_forward_pre_hook(record(i)) for i, layer in enumerate(layers)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _step() -> list[Chunk]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 900, (n,), generator=gen).tolist() for n in (11, 30, 7)]
    return [Chunk(str(i), p) for i, p in enumerate(prompts)]


def test_rows_within_counts_from_the_part_start() -> None:
    rows = torch.tensor([0, 4, 9, 10, 15])
    assert rows_within(rows, 4, 10).tolist() == [0, 5]
    assert rows_within(rows, 10, 16).tolist() == [0, 5]
    assert rows_within(rows, 1, 4).tolist() == []


@pytest.mark.parametrize("threads", [1, 2])
@torch.inference_mode()
def test_kept_rows_equal_the_whole_forward_and_every_row_writes_its_kv(
    tiny_llama: Path, threads: int
) -> None:
    model = load_model(resolve_model_config(str(tiny_llama)))
    model.microbatcher = MicroBatcher(threads) if threads > 1 else None
    keep = torch.tensor([10, 40, 47])  # each prompt's last token
    whole_driver, kept_driver = PagedDriver(model, seed=1), PagedDriver(model, seed=1)
    whole = model(*whole_driver.build(_step()))
    with mlp_rows(model) as seen:
        kept = model(*kept_driver.build(_step()), keep)
    torch.testing.assert_close(kept, whole.index_select(0, keep), atol=1e-5, rtol=0)
    for name, cache in whole_driver.kv_caches.items():
        assert torch.equal(kept_driver.kv_caches[name], cache), name
    assert seen == [48] * (len(seen) - 1) + [3]


@torch.inference_mode()
def test_a_prefill_runs_the_last_mlp_for_its_sampled_row_and_prompt_logprobs_for_all(
    tiny_llama: Path,
) -> None:
    llm = make_llm(tiny_llama, prefix_caching=False)  # the second prompt computes every row again
    model = llm.engine.executor.worker.runner.model
    prompt = {"prompt_token_ids": list(range(5, 45))}
    with mlp_rows(model) as seen:
        (plain,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    assert seen[0] == 40 and seen[-1] == 1
    with mlp_rows(model) as seen:
        (scored,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    assert seen[-1] == 40  # every row's logits were read
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids
    assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == 40
