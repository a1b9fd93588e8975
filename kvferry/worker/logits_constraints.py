"""Per-request logit constraints, applied batched in the sampler: ``allowed_token_ids``,
``bad_words``, ``min_tokens`` (EOS and stop token ids masked until that many outputs) and
``logit_bias``, with vLLM's semantics. A structured-output grammar outranks min_tokens: once
it is complete and allows only EOS, the sampler releases the row's held stop tokens (as vLLM
does since its PR 54218) instead of leaving the row without a token.

The batch is built from the few (row, token) pairs the requests name (a loop over their
entries, never over the vocabulary) and applied with one scatter per kind. A batch where
no request uses them has none (``build_logits_constraints`` returns None): the sampler
skips the step. Raw logprobs are taken before it, as vLLM's default (``raw_logprobs``).

``bad_words``: a word of one token is never sampled; of several, its last token is masked
only where the output so far ends with the word's other tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvferry.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenPairs:
    """(row, token) pairs of a batch, with a value per pair where one is needed."""

    rows: torch.Tensor  # int64 [K]
    tokens: torch.Tensor  # int64 [K]
    values: torch.Tensor  # float32 [K] (empty where unused)

    @classmethod
    def of(cls, pairs: list[tuple[int, int]], values: list[float] | None = None) -> TokenPairs | None:
        if not pairs:
            return None
        rows, tokens = zip(*pairs, strict=True)
        return cls(
            torch.tensor(rows, dtype=torch.int64),
            torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(values or [], dtype=torch.float32),
        )

    def index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.to(device), self.tokens.to(device)

    def without_rows(self, rows: Sequence[int]) -> TokenPairs | None:
        """The pairs outside ``rows`` (values dropped); None when none is left."""
        if not rows:
            return self
        keep = ~torch.isin(self.rows, torch.tensor(list(rows), dtype=torch.int64))
        if not bool(keep.any()):
            return None
        return TokenPairs(self.rows[keep], self.tokens[keep], torch.empty(0))


@dataclass(frozen=True)
class LogitsConstraints:
    bias: TokenPairs | None  # added to the logits
    blocked: TokenPairs | None  # set to -inf (bad words)
    allowed_rows: torch.Tensor | None  # int64: rows restricted to their allowed pairs
    allowed: TokenPairs | None
    held: TokenPairs | None = None  # stop tokens held back by min_tokens: -inf unless released

    def apply(self, logits: torch.Tensor, released_rows: Sequence[int] = ()) -> torch.Tensor:
        """The constrained logits; ``released_rows`` keep their stop tokens despite min_tokens
        (a complete grammar that allows nothing else)."""
        logits = logits.clone()
        if self.allowed_rows is not None and self.allowed is not None:
            outside = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
            outside[self.allowed_rows.to(logits.device)] = True
            outside[self.allowed.index(logits.device)] = False
            logits.masked_fill_(outside, float("-inf"))
        if self.blocked is not None:
            logits[self.blocked.index(logits.device)] = float("-inf")
        held = self.held.without_rows(released_rows) if self.held is not None else None
        if held is not None:
            logits[held.index(logits.device)] = float("-inf")
        if self.bias is not None:
            bias = self.bias.values.to(device=logits.device, dtype=logits.dtype)
            logits.index_put_(self.bias.index(logits.device), bias, accumulate=True)
        return logits


def build_logits_constraints(
    params: Sequence[SamplingParams], outputs: Sequence[list[int]], eos_token_ids: Sequence[int]
) -> LogitsConstraints | None:
    """The constraints of a batch's rows (``outputs``: each row's tokens generated so far);
    None when no row has any."""
    bias: list[tuple[int, int]] = []
    bias_values: list[float] = []
    blocked: list[tuple[int, int]] = []
    held: list[tuple[int, int]] = []
    allowed: list[tuple[int, int]] = []
    allowed_rows: list[int] = []
    for row, (p, output) in enumerate(zip(params, outputs, strict=True)):
        for token, value in p.logit_bias.items():
            bias.append((row, token))
            bias_values.append(value)
        if p.allowed_token_ids is not None:
            allowed_rows.append(row)
            allowed.extend((row, token) for token in p.allowed_token_ids)
        blocked.extend((row, token) for token in banned_by_bad_words(p.bad_words_token_ids, output))
        if len(output) < p.min_tokens:
            held.extend((row, token) for token in min_tokens_stops(p, eos_token_ids))
    if not (bias or blocked or held or allowed_rows):
        return None
    return LogitsConstraints(
        bias=TokenPairs.of(bias, bias_values),
        blocked=TokenPairs.of(blocked),
        allowed_rows=torch.tensor(allowed_rows, dtype=torch.int64) if allowed_rows else None,
        allowed=TokenPairs.of(allowed),
        held=TokenPairs.of(held),
    )


def min_tokens_stops(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The tokens that would end a request: its stop token ids, and EOS unless ignored."""
    eos = [] if params.ignore_eos else list(eos_token_ids)
    return eos + list(params.stop_token_ids)


def banned_by_bad_words(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word after ``output``."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if len(prefix) > len(output):
            continue
        if not prefix or output[len(output) - len(prefix) :] == prefix:
            banned.append(word[-1])
    return banned


def uses_logits_constraints(params: SamplingParams, num_outputs: int) -> bool:
    """Whether a row needs the constraint step now (min_tokens only until it is reached)."""
    return params.uses_logits_constraints or num_outputs < params.min_tokens
