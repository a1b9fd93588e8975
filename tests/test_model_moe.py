"""Mixture-of-experts and latent-attention models on tiny random checkpoints built offline
(tests/fixtures/tiny_moe): Qwen3-MoE, DeepSeek-V2, DeepSeek-V3. Greedy tokens identical to
HF transformers (float32): batched with the captured forward, chunked, with a prefix-cache
second pass, with preemption, over two tensor-parallel ranks; pools back to full."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvferry.config import CaptureMode, MLAForm, MLAForms, MoEParallel
from kvferry.errors import ConfigError
from kvferry.kv.spec import LatentAttentionSpec
from kvferry.model.layers.linear import weight_loader_of
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.moe import FusedExperts, Router, RouterKind, expert_target
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm, tokenize_all
from tests.fixtures.tiny_moe import KV_LORA_RANK, MLA_ARCHS, MOE_ARCHS, QK_ROPE_HEAD_DIM
from tests.test_model_hybrid import hf_greedy

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
FAST_ARCH = "deepseek_v3"  # the fast tier's representative: MLA and MoE together
ARCHS = MOE_ARCHS


@pytest.fixture(scope="module")
def moe(tiny_moe: Callable[[str], Path]):
    """arch -> (model dir, prompts, HF greedy tokens), the references computed once per module."""
    cache: dict[str, tuple[Path, list[list[int]], list[list[int]]]] = {}

    def get(arch: str) -> tuple[Path, list[list[int]], list[list[int]]]:
        if arch not in cache:
            model_dir = tiny_moe(arch)
            prompts = tokenize_all(model_dir, PROMPT_TEXTS)
            cache[arch] = (model_dir, prompts, hf_greedy(model_dir, prompts))
        return cache[arch]

    return get


def _tokens(outputs) -> list[list[int]]:  # noqa: ANN001 - RequestOutputs
    return [o.outputs[0].token_ids for o in outputs]


# The default (prefill decompressed, decode absorbed) and its swap: every phase in each form.
SWAPPED = MLAForms(prefill=MLAForm.ABSORBED, decode=MLAForm.DECOMPRESSED)
DEFAULT = MLAForms()


def _slow_unless(arch: str) -> list[object]:
    cases = [(a, DEFAULT) for a in ARCHS] + [(a, SWAPPED) for a in MLA_ARCHS]
    return [
        pytest.param(
            a,
            f,
            marks=() if a == arch else pytest.mark.slow,
            id=f"{a}-{_form_id(f)}" if a in MLA_ARCHS else a,
        )
        for a, f in cases
    ]


def _form_id(forms: MLAForms) -> str:
    return f"prefill_{forms.prefill}-decode_{forms.decode}"


@pytest.mark.parametrize(("arch", "forms"), _slow_unless(FAST_ARCH))
def test_chunked_prefill_with_prefix_cache_matches_hf(moe, arch: str, forms: MLAForms) -> None:
    """Prompts in chunks of 16 tokens, then the same prompts again (prefix hits); an MLA
    model with each phase in each form (kvferry.model.layers.mla)."""
    model_dir, prompts, expected = moe(arch)
    assert max(len(p) for p in prompts) > 2 * 16  # the longest prompt takes three chunks
    llm = make_llm(model_dir, budget=16, block_size=4, enforce_eager=True, mla_forms=forms)
    first = llm.generate(prompts, GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert _tokens(first) == expected and _tokens(second) == expected
    assert sum(o.num_cached_tokens > 0 for o in second) >= 5
    assert_pool_full(llm)
    if arch in MLA_ARCHS:
        _assert_latent_cache(llm, block_size=4)


def _assert_latent_cache(llm, block_size: int) -> None:  # noqa: ANN001 - LLM
    """One latent row per token and layer, shared by the heads: a block of one layer holds
    block_size x (kv_lora_rank + qk_rope_head_dim) values, not 2 x heads x head size."""
    config = llm.engine.scheduler.kv_cache_manager.config
    (group,) = config.groups
    assert isinstance(group.spec, LatentAttentionSpec)
    assert group.spec.latent_size == KV_LORA_RANK + QK_ROPE_HEAD_DIM
    assert group.spec.page_size_bytes == block_size * (KV_LORA_RANK + QK_ROPE_HEAD_DIM) * 4
    assert len(group.layer_names) == 3


@pytest.mark.slow
@pytest.mark.parametrize("forms", [DEFAULT, SWAPPED], ids=_form_id)
def test_batched_captured_greedy_matches_hf(moe, forms: MLAForms) -> None:
    """--capture auto: warm-up compiles the decode program (experts and latent attention as
    operators inside the graph), and whichever forward it keeps answers as HF does."""
    model_dir, prompts, expected = moe("deepseek_v3")
    llm = make_llm(model_dir, capture=CaptureMode.AUTO, mla_forms=forms)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert_pool_full(llm)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v2"])  # preemption is model-independent: one MLA model
def test_preemption_with_tiny_kv_budget_matches_hf(moe, arch: str) -> None:
    model_dir, prompts, expected = moe(arch)
    llm = make_llm(model_dir, block_size=4, num_blocks=40, prefix_caching=False, enforce_eager=True)
    assert _tokens(llm.generate(prompts, GREEDY)) == expected
    assert llm.stats().num_preemptions > 0
    assert_pool_full(llm)


# Each attention under TP (GQA; MLA without q_lora, V2; MLA with q_lora, V3: its attention
# splits the same way under either MoE split) and both MoE splits, experts with a shared
# expert under EXPERT (V3). The router is replicated: it does not depend on the split.
# DeepSeek-V3 tensor-split at TP=2 also runs in tests/test_pd_mla.py and test_offload_mla.py.
_TP_CASES = [
    ("qwen3_moe", MoEParallel.TENSOR),
    ("deepseek_v2", MoEParallel.TENSOR),
    ("deepseek_v3", MoEParallel.EXPERT),
]


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "moe_parallel"), _TP_CASES)
def test_tensor_parallel_matches_hf(moe, arch: str, moe_parallel: MoEParallel) -> None:
    """Two ranks (half the heads each): TENSOR, each holds half of every expert's features;
    EXPERT, each holds 4 of the 8 experts whole."""
    model_dir, prompts, expected = moe(arch)
    llm = make_llm(model_dir, tp=2, budget=16, block_size=8, enforce_eager=True, moe_parallel=moe_parallel)
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == expected
        assert_pool_full(llm)
    finally:
        llm.engine.shutdown()


def _naive_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: FusedExperts
) -> torch.Tensor:
    """One token at a time: the definition the grouped operator must reproduce."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t], strict=True):
            gate, up = (experts.w13[e] @ x[t]).chunk(2)
            out[t] += w * (experts.w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_grouped_experts_match_per_token_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    experts = FusedExperts(num_experts=6, hidden=16, intermediate=8, tp=TPGroup(), dtype=torch.float32)
    for param in (experts.w13, experts.w2):
        param.data.copy_(torch.randn(param.shape, generator=gen))
    router = Router(RouterKind.SOFTMAX_TOPK, 6, 16, top_k=2, norm_topk_prob=True)
    router.weight.data.copy_(torch.randn(router.weight.shape, generator=gen))
    x = torch.randn(11, 16, generator=gen)
    ids, weights = router(x)
    assert len(set(ids.flatten().tolist())) > 2  # several experts, several tokens each
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(11))
    got = experts(x, ids, weights)
    torch.testing.assert_close(got, _naive_experts(x, ids, weights, experts), atol=1e-4, rtol=1e-5)
    assert experts(x[:0], ids[:0], weights[:0]).shape == (0, 16)


def _random_experts(
    gen: torch.Generator, num_experts: int, hidden: int, inter: int
) -> dict[str, torch.Tensor]:
    """A checkpoint's per-expert tensors (`mlp.experts.<e>.<proj>.weight`)."""
    shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    return {
        f"mlp.experts.{e}.{proj}.weight": torch.randn(shape, generator=gen)
        for e in range(num_experts)
        for proj, shape in shapes.items()
    }


def _load(experts: FusedExperts, weights: dict[str, torch.Tensor]) -> None:
    params = dict(experts.named_parameters(prefix="mlp.experts"))
    for name, tensor in weights.items():
        target = expert_target(name)
        assert target is not None
        param = params[target.param]
        loader = weight_loader_of(param)
        assert loader is not None
        loader(param, tensor, target.shard_id)


def _rank_share(experts: FusedExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """This rank's partial sum before the all-reduce."""
    out = torch.empty_like(x)
    torch.ops.kvferry.moe_experts(x, experts._local_ids(ids), w, experts.w13, experts.w2, out)
    return out


def test_expert_parallel_ranks_load_their_whole_experts_and_sum_to_the_full_layer() -> None:
    """--moe-parallel expert over 2 ranks: rank r holds experts 3r..3r+2 of 6, whole (every
    feature of the checkpoint's tensors); the two ranks' partial sums add up to the
    single-rank layer, each pair computed by exactly one rank."""
    gen = torch.Generator().manual_seed(1)
    weights = _random_experts(gen, num_experts=6, hidden=16, inter=8)
    full = FusedExperts(6, 16, 8, TPGroup(), torch.float32)
    _load(full, weights)
    ranks = [FusedExperts(6, 16, 8, TPGroup(r, 2, moe=MoEParallel.EXPERT), torch.float32) for r in range(2)]
    for rank, experts in enumerate(ranks):
        _load(experts, weights)
        assert experts.experts == range(3 * rank, 3 * rank + 3)
        assert experts.w13.shape == (3, 16, 16) and experts.w2.shape == (3, 16, 8)
        for local, e in enumerate(experts.experts):
            gate_up = torch.cat(
                [weights[f"mlp.experts.{e}.gate_proj.weight"], weights[f"mlp.experts.{e}.up_proj.weight"]]
            )
            torch.testing.assert_close(experts.w13[local], gate_up, rtol=0, atol=0)
            torch.testing.assert_close(
                experts.w2[local], weights[f"mlp.experts.{e}.down_proj.weight"], rtol=0, atol=0
            )
    x = torch.randn(9, 16, generator=gen)
    ids = torch.tensor([[0, 5], [1, 2], [3, 4], [5, 0], [2, 1], [4, 3], [0, 1], [5, 4], [2, 3]])
    w = torch.rand(9, 2, generator=gen)
    shares = [_rank_share(experts, x, ids, w) for experts in ranks]
    torch.testing.assert_close(shares[0] + shares[1], full(x, ids, w), atol=1e-5, rtol=1e-5)
    only_rank1 = ids[2:3]  # experts 3 and 4: rank 0 adds nothing
    assert torch.count_nonzero(_rank_share(ranks[0], x[2:3], only_rank1, w[2:3])) == 0
    with pytest.raises(ConfigError, match="do not split evenly"):
        FusedExperts(6, 16, 8, TPGroup(0, 4, moe=MoEParallel.EXPERT), torch.float32)
