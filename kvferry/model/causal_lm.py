"""What every causal LM here shares: the forward over a flat batch (micro-batched on CPU),
logits, the attention layers' names and hooks, and loading checkpoint tensors by HF name.

An architecture builds `self.model` (the decoder: `forward(input_ids, positions, ctx)`,
compiled by the captured forward), `self.lm_head`, and lists its attention layers.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvferry.errors import ModelLoadError
from kvferry.kv.spec import AttentionLayerKV
from kvferry.model.forward_context import ForwardContext, HookPlacement
from kvferry.model.layers.attention import KVCacheLayer
from kvferry.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvferry.model.layers.linear import copy_checked, weight_loader_of
from kvferry.model.microbatch import MicroBatcher, Part

logger = logging.getLogger(__name__)

# checkpoint projection -> (fused parameter, shard id)
STACKED = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)
# rope buffers some checkpoints save: recomputed here, never loaded
ROTARY_BUFFER_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
NAMED_IN_ERRORS = 5  # unexpected or missing tensors an error names (then the count)


class Skip(enum.Enum):
    """Why a checkpoint tensor is deliberately not loaded. Each architecture's `_target`
    declares which of its tensors these cover; any other tensor without a parameter here
    means the checkpoint and its config disagree (a load error)."""

    ROTARY_BUFFER = "rope buffer (recomputed)"
    TIED_LM_HEAD = "lm_head tied to the embeddings"
    OTHER_MODALITY = "vision/audio tower or projector (text only)"
    KV_SHARED_LAYER = "K/V weights of a layer reading another layer's KV"
    NEXT_TOKEN_PREDICTION = "multi-token prediction layers (DeepSeek-V3: not run)"


@dataclass(frozen=True)
class Target:
    """The parameter a checkpoint tensor loads into, and its shard of a fused parameter."""

    param: str
    shard_id: object = None


def head_dim_of(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


class LayerType(enum.StrEnum):
    """The attention layer types a config's `layer_types` may name."""

    FULL = "full_attention"
    SLIDING = "sliding_attention"


def config_layer_types(config: Any) -> list[LayerType] | None:
    """The config's `layer_types`, checked before anything (rope, shapes) reads them: an
    unsupported type is a load error naming it and the supported ones. None: not listed."""
    types = getattr(config, "layer_types", None)
    if types is None:
        return None
    supported = [t.value for t in LayerType]
    unknown = sorted(set(types) - set(supported))
    if unknown:
        raise ModelLoadError(
            f"unsupported attention layer type {', '.join(map(repr, unknown))} in the config's "
            f"layer_types; supported: {', '.join(supported)}"
        )
    if len(types) != config.num_hidden_layers:
        raise ModelLoadError(f"config lists {len(types)} layer types for {config.num_hidden_layers} layers")
    return [LayerType(t) for t in types]


def layer_types(config: Any) -> list[LayerType]:
    """Each layer's type (checked); all full attention when the config lists none."""
    return config_layer_types(config) or [LayerType.FULL] * config.num_hidden_layers


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers reads the config:
    `layer_types` when the config has them (Gemma 3, Qwen2/3 with use_sliding_window),
    otherwise `sliding_window` on every layer (Mistral)."""
    window = getattr(config, "sliding_window", None)
    types = config_layer_types(config)
    if types is None:
        return [window] * config.num_hidden_layers
    return [window if t is LayerType.SLIDING and window else None for t in types]


class DecoderModel(nn.Module):
    """Base of an architecture's decoder (`CausalLM.model`): token embeddings in, final
    hidden states out (`forward(input_ids, positions, ctx)`).

    A decoder with `prunes_rows` also takes `keep_rows` (ascending token indices; its
    fourth argument) and returns only those rows: its last layer writes every row's KV but
    runs what follows its attention (the output projection, the MLP, the final norm) for
    the kept rows alone, the rows whose logits the step samples."""

    embed_tokens: VocabParallelEmbedding
    prunes_rows = False


class CausalLM(nn.Module):
    """Base of the causal LMs. Subclasses set config, model, lm_head, tie_word_embeddings."""

    config: Any
    model: DecoderModel
    lm_head: ParallelLMHead
    tie_word_embeddings: bool = False
    final_logit_softcapping: float | None = None
    microbatcher: MicroBatcher | None = None  # see enable_microbatching
    hook_placement = HookPlacement.NONE  # see set_hook_placement
    decodes_fused = False  # every decoder layer has a one-call decode path (fuse_decode_layers)

    def enable_microbatching(self, num_threads: int) -> None:
        """Split batches over `num_threads` CPU threads (kvferry.model.microbatch); a single
        process only: with tensor parallelism every rank must issue collectives in order."""
        assert self.model.embed_tokens.tp.size == 1, "micro-batching needs a single rank"
        self.microbatcher = MicroBatcher(num_threads) if num_threads > 1 else None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        keep_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of a flat batch (decodes first, then prefill spans);
        with `keep_rows` (ascending token indices), only those rows, [len(keep_rows), hidden]
        (a decoder that `prunes_rows` skips the others' last-layer MLP)."""
        mb = self.microbatcher
        hooks = self.hook_placement is not HookPlacement.NONE  # hooks: once per layer
        parts = mb.split_batch(ctx, input_ids.shape[0]) if mb is not None and not hooks else []
        if len(parts) < 2 or mb is None:
            return self._run_decoder(input_ids, positions, ctx, keep_rows)

        def decode_part(part: Part) -> torch.Tensor:
            assert part.ctx is not None  # split_batch gives every part its context
            kept = None if keep_rows is None else rows_within(keep_rows, part.start, part.stop)
            return self._run_decoder(
                input_ids[part.start : part.stop], positions[part.start : part.stop], part.ctx, kept
            )

        return torch.cat(mb.map(decode_part, parts))

    def _run_decoder(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        keep_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        hidden: torch.Tensor
        if keep_rows is None:
            hidden = self.model(input_ids, positions, ctx)
        elif self.model.prunes_rows:
            hidden = self.model(input_ids, positions, ctx, keep_rows)
        else:
            hidden = self.model(input_ids, positions, ctx).index_select(0, keep_rows)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary float32 logits [N, vocab] for the selected hidden states [N, hidden]."""
        mb = self.microbatcher
        parts = mb.split_rows(hidden.shape[0]) if mb is not None else []
        if len(parts) < 2 or mb is None:
            return self._logits(hidden)
        return torch.cat(mb.map(lambda p: self._logits(hidden[p.start : p.stop]), parts))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if cap:  # in the model's dtype, as the reference does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def fuse_decode_layers(self) -> int:
        """Give decoder layers whose weights allow it a one-call decode path (a model family
        that has one: kvferry.model.llama; it runs in eager steps only); how many took it.
        Sets `decodes_fused` when all did."""
        return 0

    def attention_layers(self) -> list[KVCacheLayer]:
        return [module for module in self.modules() if isinstance(module, KVCacheLayer)]

    def attention_layer_names(self) -> list[str]:
        return [attn.layer_name for attn in self.attention_layers()]

    def kv_layers(self) -> list[AttentionLayerKV]:
        """What each attention layer owning a KV cache caches on this rank (kvferry.kv.allocate
        groups them); layers sharing another layer's KV own none."""
        return [attn.kv_layer() for attn in self.attention_layers() if attn.owns_kv]

    def set_hook_placement(self, placement: HookPlacement) -> None:
        """How every attention layer owning a KV cache calls the connector's per-layer hooks
        (graph_ops); a layer sharing another's KV calls none."""
        self.hook_placement = placement
        for attn in self.attention_layers():
            attn.hooks = placement if attn.owns_kv else HookPlacement.NONE

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names, unsharded) in; returns the parameter names set.
        ModelLoadError when the checkpoint has a tensor this model has no parameter for (and
        that its architecture does not skip on purpose) or lacks one of its parameters."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        skipped: Counter[Skip] = Counter()
        for name, tensor in weights:
            target = self._target(name)
            if isinstance(target, Skip):
                skipped[target] += 1
            elif target.param not in params:
                unexpected.append(name)
            else:
                self._copy_in(params[target.param], tensor, target)
                loaded.add(target.param)
        for reason, count in skipped.items():
            logger.debug("skipped %d checkpoint tensors: %s", count, reason.value)
        _check_unexpected(unexpected)
        _check_missing(set(params) - loaded)
        return loaded

    @staticmethod
    def _copy_in(param: nn.Parameter, tensor: torch.Tensor, target: Target) -> None:
        loader = weight_loader_of(param)
        if loader is None:
            copy_checked(param.data, tensor, target.param)
        else:
            loader(param, tensor, target.shard_id)

    def checkpoint_target(self, name: str) -> Target | Skip:
        """The parameter (and shard) a checkpoint name loads into, or why it is skipped."""
        return self._target(name)

    def _target(self, name: str) -> Target | Skip:
        """The parameter (and shard) a checkpoint name loads into, or why it is skipped."""
        if name.endswith(ROTARY_BUFFER_SUFFIXES):
            return Skip.ROTARY_BUFFER
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return Skip.TIED_LM_HEAD
        for ckpt, fused, shard_id in STACKED:
            if f".{ckpt}." in name:
                return Target(name.replace(f".{ckpt}.", f".{fused}."), shard_id)
        return Target(name)


def rows_within(rows: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The ascending token indices `rows` that fall in [start, stop), counted from start."""
    first, last = torch.searchsorted(rows, torch.tensor([start, stop], device=rows.device)).tolist()
    return rows[first:last] - start


def _named(names: list[str]) -> str:
    """The first few of `names` (sorted) and how many there are."""
    shown = ", ".join(sorted(names)[:NAMED_IN_ERRORS])
    more = len(names) - NAMED_IN_ERRORS
    return f"{shown}, and {more} more ({len(names)} in all)" if more > 0 else shown


def _check_unexpected(unexpected: list[str]) -> None:
    if unexpected:
        raise ModelLoadError(
            f"checkpoint has {len(unexpected)} tensors the model its config describes has no "
            f"parameter for (config and weights disagree): {_named(unexpected)}"
        )


def _check_missing(missing: set[str]) -> None:
    if missing:
        raise ModelLoadError(
            f"checkpoint lacks {len(missing)} weights the model its config describes needs "
            f"(config and weights disagree): {_named(list(missing))}"
        )
