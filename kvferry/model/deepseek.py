"""DeepSeek-V2 and V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): multi-head latent
attention (kvferry.model.layers.mla) and mixture-of-experts MLPs with shared experts
(kvferry.model.moe) after `first_k_dense_replace` dense layers.

Attention: queries from `q_proj`, or through the query LoRA (`q_a_proj`, its norm,
`q_b_proj`); keys and values from one latent row per token (`kv_a_proj_with_mqa`: the
compressed KV, normalized, then the rotary key part shared by all heads). The cache keeps
that row; attention applies `kv_b_proj` (the decompression) in the form each phase asks
(absorbed or decompressed, kvferry.model.layers.mla). Rope covers `qk_rope_head_dim` values,
laid out in interleaved pairs (V2 always, V3 with `rope_interleave`), yarn-scaled as the
config says, the softmax scale multiplied by yarn's mscale(factor, mscale_all_dim)^2.

Routing as transformers computes it: V2 softmax, top-k ("greedy") or top-k within the best
`topk_group` groups ("group_limited_greedy"), times `routed_scaling_factor`; V3 sigmoid
scores plus `e_score_correction_bias` choose among the `topk_group` groups with the best
two-expert sums, weights from the uncorrected scores (renormalized when `norm_topk_prob`),
times `routed_scaling_factor`.

Tensor parallelism splits heads (q_b/q_proj, kv_b, o_proj) and every expert's features;
the latent projections are replicated, so every rank caches the same rows.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from kvferry.errors import ModelLoadError
from kvferry.model.causal_lm import CausalLM, DecoderModel, Skip, Target
from kvferry.model.forward_context import ForwardContext
from kvferry.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvferry.model.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    attach_weight_loader,
    copy_checked,
)
from kvferry.model.layers.mla import LatentAttention
from kvferry.model.layers.norm import RMSNorm
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.layers.rotary import RotaryEmbedding, rope_parameters, rotate, yarn_softmax_scale
from kvferry.model.llama import LlamaMLP
from kvferry.model.moe import FusedExperts, Router, RouterKind, SparseMoE, check_silu, expert_target

logger = logging.getLogger(__name__)

CosSin = tuple[torch.Tensor, torch.Tensor]
LORA_NORM_EPS = 1e-6  # transformers builds the q/kv LoRA norms with their default eps
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
REPLICATED = TPGroup()  # latent projections: every rank holds them whole


class KVUpProjection(nn.Module):
    """`kv_b_proj`: latent -> each head's nope key and value; this rank's heads' rows,
    kept plain (never packed): attention reads it per head, as W_uk and W_uv, or whole to
    expand cached rows (kvferry.model.layers.mla)."""

    def __init__(self, latent: int, heads: int, nope: int, value: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp, self.heads, self.nope, self.value = tp, heads, nope, value
        self.weight = nn.Parameter(torch.empty(heads * (nope + value), latent, dtype=dtype), False)
        attach_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        rows = param.shape[0]
        copy_checked(param.data, loaded.narrow(0, self.tp.rank * rows, rows), "kv_b_proj weight")


def _rope_pairs_first(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (x0, x1), (x2, x3), ... as halves (x0, x2, ...), (x1, x3, ...):
    rotate-half of the result rotates each pair by its frequency."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class DeepseekAttention(nn.Module):
    def __init__(self, config: Any, prefix: str, tp: TPGroup, dtype: torch.dtype, interleaved: bool):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.heads = tp.split(heads, "number of attention heads")
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.latent, self.value = config.kv_lora_rank, config.v_head_dim
        self.interleaved = interleaved
        qk = self.nope + self.rope
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora = config.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = ColumnParallelLinear(hidden, config.q_lora_rank, bias, REPLICATED, dtype)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * qk, False, tp, dtype)
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk, False, tp, dtype)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            hidden, self.latent + self.rope, bias, REPLICATED, dtype
        )
        self.kv_a_layernorm = RMSNorm(self.latent, LORA_NORM_EPS, dtype)
        self.kv_b_proj = KVUpProjection(self.latent, self.heads, self.nope, self.value, tp, dtype)
        self.o_proj = RowParallelLinear(heads * self.value, hidden, bias, tp, dtype)
        scale = yarn_softmax_scale(rope_parameters(config), qk**-0.5)
        self.attn = LatentAttention(f"{prefix}.attn", self.heads, self.latent + self.rope, self.value, scale)

    def _queries(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.q_lora:
            q: torch.Tensor = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        return q.view(hidden.shape[0], self.heads, self.nope + self.rope)

    def _rotate(self, rope: CosSin, x: torch.Tensor) -> torch.Tensor:
        cos, sin = rope
        return rotate(_rope_pairs_first(x) if self.interleaved else x, cos, sin)

    def forward(self, rope: CosSin, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_nope, q_rope = torch.split(self._queries(hidden), [self.nope, self.rope], dim=-1)
        compressed: torch.Tensor = self.kv_a_proj_with_mqa(hidden)
        latent, k_rope = torch.split(compressed, [self.latent, self.rope], dim=-1)
        rows = torch.cat(
            (self.kv_a_layernorm(latent), self._rotate(rope, k_rope.unsqueeze(1)).squeeze(1)), -1
        )
        values = self.attn(q_nope, self._rotate(rope, q_rope), rows, self.kv_b_proj.weight, ctx)
        out: torch.Tensor = self.o_proj(values.reshape(num_tokens, self.heads * self.value))
        return out


def _router(config: Any, v3: bool) -> Router:
    args = (config.n_routed_experts, config.hidden_size, config.num_experts_per_tok)
    scaling = float(config.routed_scaling_factor)
    groups = (config.n_group or 1, config.topk_group or 1)
    if v3:
        kind = RouterKind.SIGMOID_BIAS_GROUPED
        return Router(kind, *args, norm_topk_prob=bool(config.norm_topk_prob), scaling=scaling, groups=groups)
    methods = {"greedy": RouterKind.SOFTMAX_TOPK, "group_limited_greedy": RouterKind.SOFTMAX_GROUP_LIMITED}
    if config.topk_method not in methods:
        raise ModelLoadError(
            f"DeepSeek-V2 topk_method {config.topk_method!r} is not supported ({', '.join(methods)})"
        )
    return Router(methods[config.topk_method], *args, scaling=scaling, groups=groups)


def deepseek_mlp(config: Any, index: int, tp: TPGroup, dtype: torch.dtype, v3: bool) -> nn.Module:
    """Layer `index`'s MLP: dense before `first_k_dense_replace`, then routed + shared experts."""
    if index < (config.first_k_dense_replace or 0):
        return LlamaMLP(config, tp, dtype)
    check_silu(config)
    inter = config.moe_intermediate_size
    experts = FusedExperts(config.n_routed_experts, config.hidden_size, inter, tp, dtype)
    shared = LlamaMLP(config, tp, dtype, inter * config.n_shared_experts) if config.n_shared_experts else None
    return SparseMoE(_router(config, v3), experts, shared)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, tp: TPGroup, dtype: torch.dtype, v3: bool):
        super().__init__()
        interleaved = bool(getattr(config, "rope_interleave", True)) if v3 else True
        prefix = f"model.layers.{index}.self_attn"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = DeepseekAttention(config, prefix, tp, dtype, interleaved)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = deepseek_mlp(config, index, tp, dtype, v3)

    def forward(
        self, rope: CosSin, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        out: torch.Tensor = self.mlp(hidden)
        return out, residual


class DeepseekModel(DecoderModel):
    def __init__(self, config: Any, tp: TPGroup, dtype: torch.dtype, v3: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        params = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, config.max_position_embeddings, params)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, tp, dtype, v3) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        rope = self.rotary_emb.cos_sin(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekV2ForCausalLM(CausalLM):
    """DeepSeek-V2 (and V2-Lite: no query LoRA)."""

    model: DeepseekModel
    V3 = False

    def __init__(self, config: Any, tp: TPGroup | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        tp = tp or TPGroup()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = DeepseekModel(config, tp, dtype, self.V3)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def _target(self, name: str) -> Target | Skip:
        layer = _LAYER_INDEX.match(name)
        extra = int(getattr(self.config, "num_nextn_predict_layers", 0) or 0)
        if layer and self.config.num_hidden_layers <= int(layer[1]) < self.config.num_hidden_layers + extra:
            return Skip.NEXT_TOKEN_PREDICTION
        if ".self_attn.q_proj." in name:  # its own projection here, not a fused q/k/v shard
            return Target(name)
        return expert_target(name) or super()._target(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1: sigmoid routing with a correction bias, optional rope interleave."""

    V3 = True
