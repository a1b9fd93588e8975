"""Gemma 3 (text): sliding-window and full-attention layers with their own rope, sandwich
norms around attention and MLP, Gemma's (1 + w) RMSNorm, q/k norm, embeddings scaled by
sqrt(hidden), `query_pre_attn_scalar` as the attention scale, `final_logit_softcapping`
when the config sets it. `attn_logit_softcapping` is left unapplied, as transformers'
Gemma 3 leaves it (the field survives in the config from Gemma 2; no Gemma 3 sets it).

Module names mirror transformers' `Gemma3ForCausalLM`, except the fused `qkv_proj` and
`gate_up_proj` (kvferry.model.causal_lm.STACKED).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.errors import ModelLoadError
from kvferry.model.causal_lm import (
    CausalLM,
    DecoderModel,
    Skip,
    Target,
    head_dim_of,
    layer_types,
    layer_windows,
)
from kvferry.model.forward_context import ForwardContext
from kvferry.model.layers.attention import PagedAttention
from kvferry.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvferry.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvferry.model.layers.norm import GemmaRMSNorm
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.layers.rotary import RotaryEmbedding, apply_rope, rope_parameters, rope_per_kind

logger = logging.getLogger(__name__)

CosSin = tuple[torch.Tensor, torch.Tensor]
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # transformers' tanh approximations


class Gemma3Attention(nn.Module):
    def __init__(self, config: Any, prefix: str, tp: TPGroup, dtype: torch.dtype, window: int | None):
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, heads, kv_heads, bias, tp, dtype)
        shard = self.qkv_proj.shard
        self.o_proj = RowParallelLinear(
            heads * head_dim,
            config.hidden_size,
            bias,
            tp,
            dtype,
            in_range=(shard.q_start * head_dim, shard.num_heads * head_dim),
        )
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.head_dim = head_dim
        self.attn = PagedAttention(
            f"{prefix}.attn",
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            sliding_window=window,
        )

    def forward(self, rope: CosSin, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        q = self.q_norm(q.view(q.shape[0], self.qkv_proj.num_heads, self.head_dim))
        k = self.k_norm(k.view(k.shape[0], self.qkv_proj.num_kv_heads, self.head_dim))
        q, k = apply_rope(rope, q, k)
        out: torch.Tensor = self.o_proj(self.attn(q, k, v, ctx))
        return out


class Gemma3MLP(nn.Module):
    """Gated tanh-GELU MLP of the Gemma models; `intermediate` overrides the config's width."""

    def __init__(self, config: Any, tp: TPGroup, dtype: torch.dtype, intermediate: int | None = None):
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if activation not in GELU_TANH:
            raise ModelLoadError(
                f"Gemma MLP activation {activation!r} is not supported ({', '.join(GELU_TANH)})"
            )
        inter = intermediate or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], False, tp, dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return out


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: each sub-block's input and output are normalized."""

    def __init__(self, config: Any, prefix: str, tp: TPGroup, dtype: torch.dtype, window: int | None):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, f"{prefix}.self_attn", tp, dtype, window)
        self.mlp = Gemma3MLP(config, tp, dtype)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, rope: CosSin, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        attn = self.self_attn(rope, self.input_layernorm(hidden), ctx)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        out: torch.Tensor = hidden + self.post_feedforward_layernorm(mlp)
        return out


class Gemma3Model(DecoderModel):
    embed_scale: torch.Tensor  # a buffer

    def __init__(self, config: Any, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        # transformers rounds sqrt(hidden) to the weights' dtype before scaling
        self.register_buffer(
            "embed_scale", torch.tensor(config.hidden_size**0.5, dtype=dtype), persistent=False
        )
        self.layer_types = layer_types(config)  # checked first: rope and windows read them
        windows = layer_windows(config)
        # Rope per layer type, each from its own parameters (sliding layers: the local base).
        self.rope = nn.ModuleDict(
            {
                kind.value: RotaryEmbedding(
                    head_dim_of(config), config.max_position_embeddings, rope_parameters(config, kind)
                )
                for kind in sorted(set(self.layer_types))
            }
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, f"model.layers.{i}", tp, dtype, window)
            for i, window in enumerate(windows)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        ropes = rope_per_kind(self.rope, positions, hidden.dtype)
        for kind, layer in zip(self.layer_types, self.layers, strict=True):
            hidden = layer(ropes[kind], hidden, ctx)
        out: torch.Tensor = self.norm(hidden)
        return out


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text model (`Gemma3ForCausalLM`, model_type gemma3_text)."""

    model: Gemma3Model

    def __init__(self, config: Any, tp: TPGroup | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        tp = tp or TPGroup()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.model = Gemma3Model(config, tp, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text half of a multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`,
    model_type gemma3: the 4B, 12B and 27B releases): the language model under
    `language_model.`; the vision tower and projector are not loaded (text prompts only)."""

    VISION_PREFIXES = (
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    )

    def __init__(self, config: Any, tp: TPGroup | None = None, dtype: torch.dtype = torch.float32):
        super().__init__(config.get_text_config(), tp, dtype)

    def _target(self, name: str) -> Target | Skip:
        text_name = language_model_name(name, self.VISION_PREFIXES)
        return Skip.OTHER_MODALITY if text_name is None else super()._target(text_name)


def language_model_name(name: str, other_prefixes: tuple[str, ...]) -> str | None:
    """A multimodal checkpoint's tensor name as its text model names it (`model.layers...`,
    `lm_head...`); None for the towers and projectors under `other_prefixes`."""
    if name.startswith(other_prefixes):
        return None
    name = name.removeprefix("model.").removeprefix("language_model.")
    if not name.startswith(("model.", "lm_head.")):
        name = f"model.{name}"  # transformers 5 saves model.language_model.<layers...>
    return name
