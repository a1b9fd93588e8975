"""The Llama family: Llama 2/3 (and SmolLM2), Qwen2 (qkv bias), Qwen3 (per-head q/k norm).

Module names mirror transformers' so checkpoint names map one to one, except the fused
`qkv_proj` (q/k/v_proj) and `gate_up_proj` (gate/up_proj).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from kvferry.errors import ModelLoadError
from kvferry.model.forward_context import ForwardContext, HookPlacement
from kvferry.model.layers.activation import SiluAndMul
from kvferry.model.layers.attention import PagedAttention
from kvferry.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvferry.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    copy_checked,
)
from kvferry.model.layers.norm import RMSNorm
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.layers.rotary import RotaryEmbedding, apply_rope, rope_parameters
from kvferry.model.microbatch import MicroBatcher

logger = logging.getLogger(__name__)

CosSin = tuple[torch.Tensor, torch.Tensor]  # rope at this forward's positions

# checkpoint projection -> (fused parameter, shard id)
STACKED = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)
# checkpoint entries that are not parameters here
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        prefix: str,
        tp: TPGroup,
        dtype: torch.dtype,
        flags: dict[str, bool],
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
        )

    def forward(self, rope: CosSin, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        q = q.view(q.shape[0], self.qkv_proj.num_heads, self.head_dim)
        k = k.view(k.shape[0], self.qkv_proj.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(rope, q, k)
        return self.o_proj(self.attn(q, k, v, ctx))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias, tp, dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, tp, dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        prefix: str,
        tp: TPGroup,
        dtype: torch.dtype,
        flags: dict[str, bool],
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, f"{prefix}.self_attn", tp, dtype, flags)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, tp, dtype)

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, tp: TPGroup, dtype: torch.dtype, flags: dict[str, bool]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        rope = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters(config))
        self.rotary_emb = rope
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, f"model.layers.{i}", tp, dtype, flags)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb.cos_sin(positions, hidden.dtype)  # the same for every layer
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Causal LM of the Llama family. See kvferry.model.registry for the names it serves."""

    def __init__(self, config: Any, tp: TPGroup | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        tp = tp or TPGroup()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaModel(config, tp, dtype, self.flags(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)
        self.microbatcher: MicroBatcher | None = None  # see enable_microbatching
        self.hook_placement = HookPlacement.NONE  # see set_hook_placement

    @staticmethod
    def flags(config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def enable_microbatching(self, num_threads: int) -> None:
        """Split batches over `num_threads` CPU threads (kvferry.model.microbatch); a single
        process only: with tensor parallelism every rank must issue collectives in order."""
        assert self.model.embed_tokens.tp.size == 1, "micro-batching needs a single rank"
        self.microbatcher = MicroBatcher(num_threads) if num_threads > 1 else None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final hidden states [T, hidden] of a flat batch (decodes first, then prefill spans)."""
        mb = self.microbatcher
        splittable = mb is not None and self.hook_placement is HookPlacement.NONE  # hooks: once per layer
        parts = mb.split_batch(ctx, input_ids.shape[0]) if splittable else []
        if len(parts) < 2:
            return self.model(input_ids, positions, ctx)
        outs = mb.map(
            lambda p: self.model(input_ids[p.start : p.stop], positions[p.start : p.stop], p.ctx), parts
        )
        return torch.cat(outs)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits [N, vocab] for the selected hidden states [N, hidden]."""
        mb = self.microbatcher
        parts = mb.split_rows(hidden.shape[0]) if mb is not None else []
        if len(parts) < 2:
            return self.lm_head(hidden).float()
        return torch.cat(mb.map(lambda p: self.lm_head(hidden[p.start : p.stop]).float(), parts))

    def attention_layer_names(self) -> list[str]:
        return [layer.self_attn.attn.layer_name for layer in self.model.layers]

    def set_hook_placement(self, placement: HookPlacement) -> None:
        """How every attention layer calls the connector's per-layer hooks (graph_ops)."""
        self.hook_placement = placement
        for layer in self.model.layers:
            layer.self_attn.attn.hooks = placement

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this tensor-parallel rank caches (ranks may differ)."""
        return self.model.layers[0].self_attn.attn.num_kv_heads

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names, unsharded) in; returns the parameter names set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target, shard_id = self._target(name)
            if target is None:
                continue
            if target not in params:
                logger.warning("checkpoint tensor %s has no matching parameter; skipped", name)
                continue
            param = params[target]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                copy_checked(param.data, tensor, target)
            else:
                loader(param, tensor, shard_id)
            loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise ModelLoadError(f"checkpoint lacks weights for: {', '.join(sorted(missing)[:8])}")
        return loaded

    def _target(self, name: str) -> tuple[str | None, object]:
        """The parameter (and shard) a checkpoint name loads into; None to skip it."""
        if name.endswith(IGNORED_SUFFIXES):
            return None, None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None, None
        for ckpt, fused, shard_id in STACKED:
            if f".{ckpt}." in name:
                return name.replace(f".{ckpt}.", f".{fused}."), shard_id
        return name, None


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def flags(config: Any) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def flags(config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
