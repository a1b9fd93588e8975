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
from kvferry.model.layers.fused_decode import FusedDecodeLayer
from kvferry.model.loader import load_model
from kvferry.model.microbatch import MicroBatcher
from kvferry.model.resolve import resolve_model_config
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import make_llm
from tests.fixtures.paged import Chunk, PagedDriver


@contextmanager
def mlp_rows(model: CausalLM) -> Iterator[list[int]]:
    """Rows each layer (index) runs its MLP for, summed over the calls made while open
    (micro-batch parts included): given to the MLP module, or, for a layer that decodes
    fused (float32 tiles), to the fused layer's code after its attention."""
    layers = model.model.layers
    seen = [0] * len(layers)

    def record(index: int):
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen[index] += args[0].shape[0]

        return hook

    handles = [layer.mlp.register_forward_pre_hook(record(i)) for i, layer in enumerate(layers)]
    fused = [layer.fused_decode for layer in layers]
    for index, layer in enumerate(layers):
        if layer.fused_decode is not None:
            layer.fused_decode = TailRows(layer.fused_decode, seen, index)
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
        for layer, original in zip(layers, fused, strict=True):
            layer.fused_decode = original


class TailRows:
    """A fused layer that counts the rows its code after the attention runs for."""

    def __init__(self, layer: FusedDecodeLayer, seen: list[int], index: int):
        self.layer, self.seen, self.index = layer, seen, index

    def run(self, rope, hidden, residual, ctx):  # type: ignore[no-untyped-def]
        out = self.layer.run(rope, hidden, residual, ctx)
        self.seen[self.index] += 0 if out is None else hidden.shape[0]
        return out

    def run_in_parts(self, rope, hidden, residual, ctx, keep_rows=None):  # type: ignore[no-untyped-def]
        out = self.layer.run_in_parts(rope, hidden, residual, ctx, keep_rows)
        self.seen[self.index] += hidden.shape[0] if keep_rows is None else keep_rows.numel()
        return out


def _step() -> list[Chunk]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 800, (n,), generator=gen).tolist() for n in (11, 30, 7)]
    return [Chunk(str(i), p) for i, p in enumerate(prompts)]


def test_rows_within_counts_from_the_part_start() -> None:
    rows = torch.tensor([0, 4, 9, 10, 15])
    assert rows_within(rows, 4, 10).tolist() == [0, 5]
    assert rows_within(rows, 10, 16).tolist() == [0, 5]
    assert rows_within(rows, 1, 4).tolist() == []


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen3"], ids=["fused-layers", "module-layers"])
@torch.inference_mode()
def test_kept_rows_equal_the_whole_forward_and_every_row_writes_its_kv(
    request: pytest.FixtureRequest, arch: str, threads: int
) -> None:
    """The tiny Llama's layers run fused (float32 tiles), the tiny Qwen3's (q/k norms) as
    modules: both prune."""
    model = load_model(resolve_model_config(str(request.getfixturevalue(f"tiny_{arch}"))))
    assert all((layer.fused_decode is not None) is (arch == "llama") for layer in model.model.layers)
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
