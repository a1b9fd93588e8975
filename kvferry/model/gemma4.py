"""Gemma 4 (text, dense): Gemma 3's layout (sliding and full layers, sandwich norms, q/k
norm, embeddings scaled by sqrt(hidden), `final_logit_softcapping`) with Gemma 4's own:

- per-layer attention shapes: the full-attention layers have their own head size and KV
  head count (`per_layer_config`, transformers' `global_head_dim`), and their rope is
  `proportional` (part of the frequency pairs rotate); rope parameters per layer type;
- RMSNorm weights stored as the scale itself, values normed without a scale (`v_norm`),
  attention scale 1, a learned `layer_scalar` multiplying each layer's output;
- per-layer input embeddings (`hidden_size_per_layer_input`): a second embedding, mixed
  with a projection of the main one, gates a residual branch after each layer's MLP;
- `attention_k_eq_v`: full layers without a value projection (values are the raw keys,
  normed); the key weights load into both halves of the fused projection;
- `num_kv_shared_layers`: the last N layers own no KV cache; each reads the KV of the last
  earlier layer of its type (its step's k/v and its cache) and writes nothing;
- `use_double_wide_mlp`: the KV-shared layers' MLP twice as wide.

Mixture-of-experts blocks and bidirectional attention are refused (ModelLoadError).
Module names mirror transformers' `Gemma4ForCausalLM`, except the fused `qkv_proj` and
`gate_up_proj` (kvferry.model.causal_lm.STACKED).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.errors import ModelLoadError
from kvferry.model.causal_lm import (
    CausalLM,
    DecoderModel,
    LayerType,
    Skip,
    Target,
    layer_types,
    layer_windows,
)
from kvferry.model.forward_context import ForwardContext
from kvferry.model.gemma3 import Gemma3MLP, language_model_name
from kvferry.model.layers.attention import PagedAttention
from kvferry.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvferry.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    QueryParallelLinear,
    RowParallelLinear,
)
from kvferry.model.layers.norm import GemmaRMSNorm, UnscaledRMSNorm
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.layers.rotary import RotaryEmbedding, rope_parameters, rope_per_kind, rotate

logger = logging.getLogger(__name__)

CosSin = tuple[torch.Tensor, torch.Tensor]
StepKV = tuple[torch.Tensor, torch.Tensor]  # a layer's k and v of this step [T, kv_heads, D]
REPLICATED = TPGroup()  # small per-layer-input weights: whole on every rank
LAYER_INDEX = re.compile(r"\blayers\.(\d+)\.")
SHARED_LAYER_SKIPPED = ("k_proj", "v_proj", "k_norm", "v_norm")


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer as the config states it."""

    kind: LayerType
    window: int | None
    head_dim: int
    num_kv_heads: int
    kv_source: int | None  # the layer whose KV this one reads (None: its own)
    k_eq_v: bool  # values are the raw keys (no value projection)
    mlp_width: int


def _layer_value(config: Any, index: int, name: str) -> Any:
    """A per-layer attribute (transformers 5's heterogeneous configs keep it per layer)."""
    if getattr(config, "is_heterogeneous", False):
        return getattr(config.per_layer_config[index], name)
    return getattr(config, name)


def _kv_sources(types: list[LayerType], num_shared: int) -> list[int | None]:
    """For each layer, the layer whose KV it reads: the last N layers read the last
    earlier layer of their own type; the others their own."""
    first_shared = len(types) - num_shared
    sources: list[int | None] = [None] * len(types)
    for i in range(first_shared, len(types)):
        owners = [j for j in range(first_shared) if types[j] == types[i]]
        if not owners:
            raise ModelLoadError(f"KV-shared layer {i} ({types[i]}) has no earlier layer of its type")
        sources[i] = owners[-1]
    return sources


def layer_plans(config: Any) -> list[LayerPlan]:
    _check_supported(config)
    types = layer_types(config)
    sources = _kv_sources(types, int(getattr(config, "num_kv_shared_layers", 0) or 0))
    k_eq_v = bool(getattr(config, "attention_k_eq_v", False))
    wide = bool(getattr(config, "use_double_wide_mlp", False))
    return [
        LayerPlan(
            kind=kind,
            window=window,
            head_dim=int(_layer_value(config, i, "head_dim")),
            num_kv_heads=int(_layer_value(config, i, "num_key_value_heads")),
            kv_source=source,
            k_eq_v=k_eq_v and kind is not LayerType.SLIDING,
            mlp_width=config.intermediate_size * (2 if wide and source is not None else 1),
        )
        for i, (kind, window, source) in enumerate(zip(types, layer_windows(config), sources, strict=True))
    ]


def _check_supported(config: Any) -> None:
    if getattr(config, "enable_moe_block", False):
        raise ModelLoadError("Gemma 4 mixture-of-experts blocks are not supported (dense models only)")
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise ModelLoadError("Gemma 4 with bidirectional attention on all tokens is not a causal LM")


class Gemma4Attention(nn.Module):
    """q/k norm with scale, v norm without, attention scale 1. A KV-shared layer has only
    its query projection and attends the source layer's step k/v and cache."""

    def __init__(self, config: Any, plan: LayerPlan, prefix: str, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        heads, head_dim, eps = config.num_attention_heads, plan.head_dim, config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))
        args = (config.hidden_size, head_dim, heads, plan.num_kv_heads, bias, tp, dtype)
        if plan.kv_source is None:
            self.qkv_proj = QKVParallelLinear(*args)
            self.k_norm = GemmaRMSNorm(head_dim, eps, weight_offset=0.0)
            self.v_norm = UnscaledRMSNorm(eps)
            shard = self.qkv_proj.shard
        else:
            self.q_proj = QueryParallelLinear(*args)
            shard = self.q_proj.shard
        self.o_proj = RowParallelLinear(
            heads * head_dim,
            config.hidden_size,
            bias,
            tp,
            dtype,
            in_range=(shard.q_start * head_dim, shard.num_heads * head_dim),
        )
        self.q_norm = GemmaRMSNorm(head_dim, eps, weight_offset=0.0)
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, shard.num_heads, shard.num_kv_heads
        owner = None if plan.kv_source is None else f"model.layers.{plan.kv_source}.self_attn.attn"
        self.attn = PagedAttention(
            f"{prefix}.attn", shard.num_heads, shard.num_kv_heads, head_dim, 1.0, plan.window, owner
        )

    def forward(
        self, rope: CosSin, hidden: torch.Tensor, ctx: ForwardContext, shared: StepKV | None
    ) -> tuple[torch.Tensor, StepKV]:
        if shared is None:
            q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
            k, v = self._keys_values(rope, k, v)
        else:
            q, (k, v) = self.q_proj(hidden), shared
        q = rotate(self.q_norm(q.view(q.shape[0], self.num_heads, self.head_dim)), *rope)
        out: torch.Tensor = self.o_proj(self.attn(q, k, v, ctx))
        return out, (k, v)

    def _keys_values(self, rope: CosSin, k: torch.Tensor, v: torch.Tensor) -> StepKV:
        shape = (k.shape[0], self.num_kv_heads, self.head_dim)
        return rotate(self.k_norm(k.view(shape)), *rope), self.v_norm(v.view(shape))


class Gemma4DecoderLayer(nn.Module):
    """Sandwich norms around attention and MLP, the per-layer input branch, then the
    layer's scalar."""

    def __init__(self, config: Any, plan: LayerPlan, prefix: str, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, plan, f"{prefix}.self_attn", tp, dtype)
        self.mlp = Gemma3MLP(config, tp, dtype, intermediate=plan.mlp_width)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, weight_offset=0.0)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, weight_offset=0.0)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, weight_offset=0.0)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, weight_offset=0.0)
        self.has_per_layer_input = bool(_per_layer_width(config))
        if self.has_per_layer_input:
            self._add_per_layer_input_branch(config, dtype)
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        ctx: ForwardContext,
        per_layer_input: torch.Tensor | None,
        shared: StepKV | None,
    ) -> tuple[torch.Tensor, StepKV]:
        attn, kv = self.self_attn(rope, self.input_layernorm(hidden), ctx, shared)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        hidden = hidden + self.post_feedforward_layernorm(mlp)
        if self.has_per_layer_input and per_layer_input is not None:
            hidden = hidden + self._per_layer_input_branch(hidden, per_layer_input)
        out: torch.Tensor = hidden * self.layer_scalar
        return out, kv

    def _add_per_layer_input_branch(self, config: Any, dtype: torch.dtype) -> None:
        hidden, width = config.hidden_size, _per_layer_width(config)
        self.per_layer_input_gate = ColumnParallelLinear(hidden, width, False, REPLICATED, dtype)
        self.per_layer_projection = ColumnParallelLinear(width, hidden, False, REPLICATED, dtype)
        self.post_per_layer_input_norm = GemmaRMSNorm(hidden, config.rms_norm_eps, weight_offset=0.0)

    def _per_layer_input_branch(self, hidden: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        """The residual branch this layer's per-layer input gates (after the MLP)."""
        gate = F.gelu(self.per_layer_input_gate(hidden), approximate="tanh") * per_layer_input
        out: torch.Tensor = self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return out


def _per_layer_width(config: Any) -> int:
    return int(getattr(config, "hidden_size_per_layer_input", 0) or 0)


class Gemma4Model(DecoderModel):
    embed_scale: torch.Tensor  # buffers
    per_layer_embed_scale: torch.Tensor

    def __init__(self, config: Any, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.plans = layer_plans(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        # transformers rounds sqrt(hidden) to the weights' dtype before scaling
        self.register_buffer(
            "embed_scale", torch.tensor(config.hidden_size**0.5, dtype=dtype), persistent=False
        )
        self.per_layer_shape = (config.num_hidden_layers, _per_layer_width(config))
        if _per_layer_width(config):
            self._add_per_layer_inputs(config, dtype)
        self.rope = nn.ModuleDict(
            {kind.value: self._rope(config, kind) for kind in sorted({p.kind for p in self.plans})}
        )
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, plan, f"model.layers.{i}", tp, dtype)
            for i, plan in enumerate(self.plans)
        )
        self.kv_read_by_others = {p.kv_source for p in self.plans if p.kv_source is not None}
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, weight_offset=0.0)

    def _add_per_layer_inputs(self, config: Any, dtype: torch.dtype) -> None:
        layers, width = self.per_layer_shape
        vocab = getattr(config, "vocab_size_per_layer_input", None) or config.vocab_size
        self.embed_tokens_per_layer = VocabParallelEmbedding(vocab, layers * width, REPLICATED, dtype)
        self.register_buffer("per_layer_embed_scale", torch.tensor(width**0.5, dtype=dtype), persistent=False)
        self.per_layer_model_projection = ColumnParallelLinear(
            config.hidden_size, layers * width, False, REPLICATED, dtype
        )
        self.per_layer_projection_norm = GemmaRMSNorm(width, config.rms_norm_eps, weight_offset=0.0)

    def _per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor | None:
        """Each layer's input [T, layers, width]: its slice of a second embedding table,
        mixed with a normed projection of the (scaled) main embedding; None without them."""
        if not self.per_layer_shape[1]:
            return None
        tokens = self.embed_tokens_per_layer(input_ids) * self.per_layer_embed_scale
        projected = self.per_layer_model_projection(embeds) * embeds.shape[-1] ** -0.5
        projected = self.per_layer_projection_norm(projected.view(-1, *self.per_layer_shape))
        inputs: torch.Tensor = (projected + tokens.view(-1, *self.per_layer_shape)) * 2**-0.5
        return inputs

    def _rope(self, config: Any, kind: LayerType) -> RotaryEmbedding:
        head_dim = next(p.head_dim for p in self.plans if p.kind == kind)  # equal within a type
        return RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters(config, kind))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        per_layer = self._per_layer_inputs(input_ids, hidden)
        ropes = rope_per_kind(self.rope, positions, hidden.dtype)
        step_kv: dict[int, StepKV] = {}  # k/v of this step of the layers others read
        for i, (plan, layer) in enumerate(zip(self.plans, self.layers, strict=True)):
            shared = step_kv[plan.kv_source] if plan.kv_source is not None else None
            layer_input = per_layer[:, i] if per_layer is not None else None
            hidden, kv = layer(ropes[plan.kind], hidden, ctx, layer_input, shared)
            if i in self.kv_read_by_others:
                step_kv[i] = kv
        out: torch.Tensor = self.norm(hidden)
        return out


class Gemma4ForCausalLM(CausalLM):
    """Gemma 4 text model (`Gemma4ForCausalLM`, model_type gemma4_text)."""

    model: Gemma4Model

    def __init__(self, config: Any, tp: TPGroup | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        tp = tp or TPGroup()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.model = Gemma4Model(config, tp, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._with_values_of_keys(weights))

    def _with_values_of_keys(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`attention_k_eq_v` layers: their key weights also load as their value weights."""
        for name, tensor in weights:
            yield name, tensor
            plan = self._plan_of(name)
            if plan is not None and plan.k_eq_v and plan.kv_source is None and ".k_proj." in name:
                yield name.replace(".k_proj.", ".v_proj."), tensor

    def _plan_of(self, name: str) -> LayerPlan | None:
        match = LAYER_INDEX.search(name)
        plans = self.model.plans
        return plans[int(match.group(1))] if match and int(match.group(1)) < len(plans) else None

    def _target(self, name: str) -> Target | Skip:
        plan = self._plan_of(name)
        if plan is not None and plan.kv_source is not None and ".self_attn." in name:
            if any(f".self_attn.{skipped}." in name for skipped in SHARED_LAYER_SKIPPED):
                return Skip.KV_SHARED_LAYER  # their KV weights are unused
            if ".self_attn.q_proj." in name:
                return Target(name)  # a query projection of its own, not fused
        return super()._target(name)


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The text half of a multimodal Gemma 4 checkpoint (`Gemma4ForConditionalGeneration`,
    model_type gemma4: the released checkpoints): the language model under
    `language_model.`; the vision and audio towers and their embedders are not loaded
    (text prompts only)."""

    OTHER_PREFIXES = tuple(
        f"{root}{part}."
        for root in ("", "model.")
        for part in ("vision_tower", "audio_tower", "embed_vision", "embed_audio")
    )

    def __init__(self, config: Any, tp: TPGroup | None = None, dtype: torch.dtype = torch.float32):
        super().__init__(config.get_text_config(), tp, dtype)

    def _target(self, name: str) -> Target | Skip:
        text_name = language_model_name(name, self.OTHER_PREFIXES)
        return Skip.OTHER_MODALITY if text_name is None else super()._target(text_name)
