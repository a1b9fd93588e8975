"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head q/k norm) with sparse
mixture-of-experts MLPs (kvferry.model.moe): softmax router, top-k experts, weights
renormalized when `norm_topk_prob`. Layers listed in `mlp_only_layers`, or off the
`decoder_sparse_step` stride, keep a dense MLP, as in transformers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvferry.model.causal_lm import Skip, Target
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.llama import MLPFactory, Qwen3ForCausalLM
from kvferry.model.moe import FusedExperts, Router, RouterKind, SparseMoE, check_silu, expert_target

logger = logging.getLogger(__name__)


def is_sparse_layer(config: Any, index: int) -> bool:
    """Whether layer `index` routes its MLP through experts (transformers' rule)."""
    only_dense = config.mlp_only_layers or []
    step = config.decoder_sparse_step or 1
    return index not in only_dense and config.num_experts > 0 and (index + 1) % step == 0


def qwen3_moe_block(config: Any, tp: TPGroup, dtype: torch.dtype) -> SparseMoE:
    check_silu(config)
    num_experts, hidden = config.num_experts, config.hidden_size
    gate = Router(
        RouterKind.SOFTMAX_TOPK,
        num_experts,
        hidden,
        config.num_experts_per_tok,
        norm_topk_prob=bool(config.norm_topk_prob),
        dtype=dtype,
    )
    return SparseMoE(gate, FusedExperts(num_experts, hidden, config.moe_intermediate_size, tp, dtype))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 attention, mixture-of-experts MLPs."""

    @staticmethod
    def mlp_factory(config: Any, tp: TPGroup, dtype: torch.dtype) -> MLPFactory:
        return lambda index: qwen3_moe_block(config, tp, dtype) if is_sparse_layer(config, index) else None

    def _target(self, name: str) -> Target | Skip:
        return expert_target(name) or super()._target(name)
