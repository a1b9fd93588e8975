"""Vocabulary-parallel embedding and LM head. Each rank holds a contiguous slice of rows."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.config import WeightQuantization
from kvferry.model.layers.gguf_kernel import GGUFBlocks
from kvferry.model.layers.linear import PackableLinear, attach_weight_loader, copy_checked
from kvferry.model.layers.parallel import TPGroup

logger = logging.getLogger(__name__)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks (padded to a multiple of size).

    Each rank looks up the ids it owns, zeros the rest, and the partial results are summed.
    """

    weight: nn.Parameter | None  # None only in a ParallelLMHead once packed (PackableLinear)

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype | None = None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size, dtype=dtype), requires_grad=False)
        attach_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        end = min(self.start + self.rows, loaded.shape[0])
        src = loaded[self.start : end]
        param.data[src.shape[0] :].zero_()
        copy_checked(param.data[: src.shape[0]], src, "vocab-parallel weight")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None, "an embedding table is never packed"
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """Output projection to the vocabulary; logits are gathered to the full vocab on every rank."""

    tied = False

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings)."""
        self.weight = embedding.weight
        self.tied = True

    def pack_weight(
        self,
        keep_plain: bool = False,
        quantization: WeightQuantization = WeightQuantization.NONE,
        blocks: GGUFBlocks | None = None,
    ) -> bool:
        # The embedding reads a tied weight. The head stays in the model's dtype under int4:
        # logits are where 4-bit rounding shows most. Under gguf it takes the checkpoint's
        # own blocks (a GGUF keeps it at 8 bits or more: Q8_0 for the embedded SmolLM2).
        if quantization is not WeightQuantization.GGUF:
            quantization, blocks = WeightQuantization.NONE, None
        return super().pack_weight(keep_plain or self.tied, quantization, blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(self.matmul(hidden))
        return logits[..., : self.vocab_size] if logits.shape[-1] != self.vocab_size else logits
