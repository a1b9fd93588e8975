"""The Llama family: Llama 2/3 (and SmolLM2), Qwen2 (qkv bias), Qwen3 (per-head q/k norm),
Mistral; sliding-window layers where the config has them (Mistral's `sliding_window`,
Qwen2/3's `use_sliding_window` with `layer_types`).

Module names mirror transformers' so checkpoint names map one to one, except the fused
`qkv_proj` (q/k/v_proj) and `gate_up_proj` (gate/up_proj).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvferry.model.causal_lm import CausalLM, DecoderModel, head_dim_of, layer_windows
from kvferry.model.forward_context import ForwardContext
from kvferry.model.layers.activation import SiluAndMul
from kvferry.model.layers.attention import PagedAttention
from kvferry.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvferry.model.layers.fused_decode import DecodeLayerParts, FusedDecodeLayer
from kvferry.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvferry.model.layers.norm import RMSNorm
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.layers.rotary import RotaryEmbedding, apply_rope, rope_parameters, rotate

logger = logging.getLogger(__name__)

CosSin = tuple[torch.Tensor, torch.Tensor]  # rope at this forward's positions


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        prefix: str,
        tp: TPGroup,
        dtype: torch.dtype,
        flags: dict[str, bool],
        sliding_window: int | None = None,
    ):
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, heads, kv_heads, flags["qkv_bias"], tp, dtype
        )
        shard = self.qkv_proj.shard  # o_proj reads this rank's query heads, however many
        self.o_proj = RowParallelLinear(
            heads * head_dim,
            config.hidden_size,
            flags["o_bias"],
            tp,
            dtype,
            in_range=(shard.q_start * head_dim, shard.num_heads * head_dim),
        )
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype) if flags["qk_norm"] else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype) if flags["qk_norm"] else None
        self.head_dim = head_dim
        self.attn = PagedAttention(
            f"{prefix}.attn",
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            scale=head_dim**-0.5,
            sliding_window=sliding_window,
        )

    def forward(
        self, rope: CosSin, hidden: torch.Tensor, ctx: ForwardContext, keep_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The attention block's output; with `keep_rows`, of those rows only (every row's KV
        is written all the same)."""
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = self.qkv_proj.split_qkv(qkv)
            q = self.q_norm(q.view(q.shape[0], self.qkv_proj.num_heads, self.head_dim))
            k = self.k_norm(k.view(k.shape[0], self.qkv_proj.num_kv_heads, self.head_dim))
            q, k = apply_rope(rope, q, k)
        else:
            q, k, v = self._rotated_qkv(rope, qkv)
        attended = self.attn(q, k, v, ctx)
        if keep_rows is not None:
            attended = attended.index_select(0, keep_rows)
        out: torch.Tensor = self.o_proj(attended)
        return out

    def _rotated_qkv(
        self, rope: CosSin, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k rotated in one pass (they are adjacent in qkv, every head at the same
        positions: half the rotary's operator calls of rotating each), and v."""
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        qk, v = qkv.split_with_sizes(((heads + kv_heads) * self.head_dim, kv_heads * self.head_dim), dim=-1)
        cos, sin = rope
        rotated = rotate(qk.reshape(qk.shape[0], heads + kv_heads, self.head_dim), cos, sin)
        q, k = rotated.split_with_sizes((heads, kv_heads), dim=1)
        return q, k, v


class LlamaMLP(nn.Module):
    """Gated SiLU MLP; `intermediate` overrides the config's width (MoE models' dense layers
    and shared experts)."""

    def __init__(self, config: Any, tp: TPGroup, dtype: torch.dtype, intermediate: int | None = None):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = intermediate or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias, tp, dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, tp, dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        prefix: str,
        tp: TPGroup,
        dtype: torch.dtype,
        flags: dict[str, bool],
        sliding_window: int | None = None,
        mlp: nn.Module | None = None,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, f"{prefix}.self_attn", tp, dtype, flags, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, tp, dtype)
        self.fused_decode: FusedDecodeLayer | None = None  # see fuse_for_decode

    def fuse_for_decode(self) -> bool:
        """Take the one-call decode path (layers.fused_decode) where this layer's weights
        allow it (float32 tiles or GGUF blocks kept; a dense MLP; no per-head q/k norms);
        whether it does."""
        attn = self.self_attn
        if attn.q_norm is not None or not isinstance(self.mlp, LlamaMLP):
            return False
        parts = DecodeLayerParts(
            input_norm=self.input_layernorm,
            qkv_proj=attn.qkv_proj,
            o_proj=attn.o_proj,
            post_norm=self.post_attention_layernorm,
            gate_up_proj=self.mlp.gate_up_proj,
            down_proj=self.mlp.down_proj,
            attention=attn.attn,
        )
        self.fused_decode = FusedDecodeLayer.of(parts)
        return self.fused_decode is not None

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        keep_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual); with `keep_rows`, of those rows only: what follows the
        attention runs for them alone (the last layer of a step that samples few rows)."""
        if self.fused_decode is not None and not torch.compiler.is_compiling():
            fused = self.fused_decode.run(rope, hidden, residual, ctx) if keep_rows is None else None
            if fused is None:  # a step the one-call path does not take: the same code in parts
                fused = self.fused_decode.run_in_parts(rope, hidden, residual, ctx, keep_rows)
            if fused is not None:
                return fused
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, ctx, keep_rows)
        if keep_rows is not None:
            residual = residual.index_select(0, keep_rows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        out: torch.Tensor = self.mlp(hidden)
        return out, residual


# layer index -> that layer's MLP (None: the config's dense MLP)
MLPFactory = Callable[[int], nn.Module | None]


class LlamaModel(DecoderModel):
    prunes_rows = True

    def __init__(
        self,
        config: Any,
        tp: TPGroup,
        dtype: torch.dtype,
        flags: dict[str, bool],
        mlp_of: MLPFactory = lambda index: None,
    ):
        super().__init__()
        windows = layer_windows(config)  # checks the layer types first
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        rope = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters(config))
        self.rotary_emb = rope
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, f"model.layers.{i}", tp, dtype, flags, window, mlp_of(i))
            for i, window in enumerate(windows)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        rope = self.rotary_emb.cos_sin(positions, hidden.dtype)  # the same for every layer
        residual = None
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(rope, hidden, residual, ctx, keep_rows if index == last else None)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    """Causal LM of the Llama family. See kvferry.model.registry for the names it serves."""

    model: LlamaModel

    def __init__(self, config: Any, tp: TPGroup | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        tp = tp or TPGroup()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaModel(config, tp, dtype, self.flags(config), self.mlp_factory(config, tp, dtype))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    @staticmethod
    def flags(config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def fuse_decode_layers(self) -> int:
        layers = self.model.layers
        fused = sum(layer.fuse_for_decode() for layer in layers if isinstance(layer, LlamaDecoderLayer))
        self.decodes_fused = fused == len(layers) > 0
        return fused

    @staticmethod
    def mlp_factory(config: Any, tp: TPGroup, dtype: torch.dtype) -> MLPFactory:
        """Each layer's MLP: the dense one (a mixture-of-experts subclass routes some)."""
        return lambda index: None


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def flags(config: Any) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def flags(config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window on every layer when the config sets `sliding_window`."""
