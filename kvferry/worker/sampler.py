"""Sampling on the device: penalties, temperature, top-k, top-p, min-p, seeds, logprobs.

A row is sampled by inverse CDF: one uniform draw u, then the first token whose cumulative
probability exceeds u. A seeded request's draw is a hash of its seed and the sampled
token's position in the sequence (seeded_draws.py), so a seed reproduces the same tokens
whatever else shares the batch, and however the request reached that position (resumed
after preemption, continued by a P/D decoder or by another decoder after a failover). (An
exponential race, argmax(p / Exp(1) noise), needs a draw per vocabulary entry: 78 ms per
step for 64 rows of a 49k vocabulary on 2 CPU cores, against 4 ms for this.)

A row may come with a forced token (a P/D decoder's first token is the prefiller's): the
row is sampled as usual, then its token replaced; its logprobs are this engine's, for the
forced token. Later tokens' draws do not depend on it (they are keyed by position).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvferry.messages.model_runner import SampleLogprobs
from kvferry.structured.backend import apply_token_bitmask
from kvferry.worker.logits_constraints import LogitsConstraints
from kvferry.worker.seeded_draws import position_draws

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Penalties:
    """Per-row penalties of a batch where some row uses them."""

    repetition: torch.Tensor  # float32 [N]; over prompt and output tokens
    presence: torch.Tensor  # float32 [N]; over output tokens
    frequency: torch.Tensor  # float32 [N]; over output tokens
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for the requests that sample this step."""

    temperature: torch.Tensor  # float32 [N]; 0 = greedy
    top_k: torch.Tensor  # int64 [N]; 0 = off
    top_p: torch.Tensor  # float32 [N]
    min_p: torch.Tensor  # float32 [N]
    # Per row, the seed (None: the engine's shared stream) and the sampled token's absolute
    # position in the sequence (prompt + outputs so far).
    seeds: list[int | None]
    positions: list[int]
    num_logprobs: list[int | None]
    penalties: Penalties | None = None  # None when no row uses them
    # Per row, the token to output instead of the sampled one (None when no row has one).
    forced_token_ids: list[int | None] | None = None
    constraints: LogitsConstraints | None = None  # None when no row uses them
    # Structured outputs: per row, the tokens its grammar allows (packed int32 bits; None
    # when no row has a grammar). kvferry/structured/backend.py
    token_bitmask: torch.Tensor | None = None

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())


@dataclass(frozen=True)
class SamplerOutput:
    tokens: list[int]
    logprobs: list[SampleLogprobs | None]
    # Rows whose constraints refuse every token (their token is void): contradictory
    # constraints the front end could not see, e.g. allowed_token_ids all banned as bad words.
    refused_rows: list[int]


class Sampler:
    def __init__(self, generator: torch.Generator):
        self.generator = generator  # shared stream for unseeded requests

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if any(n is not None for n in batch.num_logprobs) else None
        )
        logits, refused = constrain_logits(logits, batch)
        if batch.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, batch)
        token_list = apply_forced(tokens.tolist(), batch.forced_token_ids, logits.shape[-1])
        return SamplerOutput(
            token_list, gather_logprobs(raw_logprobs, token_list, batch.num_logprobs), refused
        )

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy = batch.temperature == 0
        temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
        scaled = logits / temperature.unsqueeze(1)
        scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
        probs = torch.softmax(scaled, dim=-1)
        if bool((batch.min_p > 0).any()):
            probs = apply_min_p(probs, batch.min_p)
        draws = self._uniform_draws(batch.seeds, batch.positions).to(probs.device)
        sampled = sample_inverse_cdf(probs, draws)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    def _uniform_draws(self, seeds: list[int | None], positions: list[int]) -> torch.Tensor:
        """One U[0, 1) draw per row ([N, 1], float64): a seeded row's keyed by its seed and
        position, the others' from the shared stream."""
        draws = torch.rand(len(seeds), dtype=torch.float64, generator=self.generator)
        seeded = [seed is not None for seed in seeds]
        if any(seeded):
            keyed = position_draws([seed or 0 for seed in seeds], positions)
            draws = torch.where(torch.tensor(seeded), keyed, draws)
        return draws.unsqueeze(1)


def constrain_logits(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, list[int]]:
    """The logits under the rows' constraints, penalties and grammar masks, and the rows
    left without any token. A row whose grammar allows only stop tokens that min_tokens
    holds back gets them back: the grammar is complete, so the answer ends there."""
    masked = _masked(logits, batch)
    if batch.constraints is None and batch.token_bitmask is None:
        return masked, []
    empty = _empty_rows(masked)
    if empty and batch.constraints is not None and batch.token_bitmask is not None:
        restricted = (batch.token_bitmask != -1).any(dim=-1)  # rows a grammar constrains
        grammar_rows = [row for row in empty if bool(restricted[row])]
        if grammar_rows:
            released = _masked(logits, batch, grammar_rows)
            masked[grammar_rows] = released[grammar_rows]
            empty = _empty_rows(masked)
    return masked, empty


def _masked(
    logits: torch.Tensor, batch: SamplingBatch, released_rows: list[int] | None = None
) -> torch.Tensor:
    if batch.constraints is not None:
        logits = batch.constraints.apply(logits, released_rows or ())
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    if batch.token_bitmask is not None:
        logits = apply_token_bitmask(logits, batch.token_bitmask)
    return logits


def _empty_rows(logits: torch.Tensor) -> list[int]:
    rows: list[int] = torch.isneginf(logits).all(dim=-1).nonzero().flatten().tolist()
    return rows


def sample_inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds draw * total. A token
    of probability 0 adds nothing to the sum, so it is never the first to exceed it."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    targets = draws * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return tokens.clamp_(max=probs.shape[-1] - 1)  # rounding at the very top


def apply_forced(tokens: list[int], forced: list[int | None] | None, vocab_size: int) -> list[int]:
    """The sampled tokens, with each forced row's token in place of its sample."""
    if forced is None:
        return tokens
    assert all(f is None or 0 <= f < vocab_size for f in forced), (
        f"forced token outside the vocabulary: {forced}"
    )
    return [sampled if f is None else f for sampled, f in zip(tokens, forced, strict=True)]


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition penalty over prompt+output tokens; presence/frequency over output tokens."""
    num_rows, vocab = logits.shape
    output_counts = _token_counts(penalties.output_token_ids, num_rows, vocab)
    seen = _token_counts(penalties.prompt_token_ids, num_rows, vocab) + output_counts > 0
    rep = penalties.repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - penalties.frequency.unsqueeze(1) * output_counts
    return logits - penalties.presence.unsqueeze(1) * (output_counts > 0).float()


def _token_counts(token_lists: list[list[int]], num_rows: int, vocab: int) -> torch.Tensor:
    counts = torch.zeros(num_rows, vocab, dtype=torch.float32)
    for row, ids in enumerate(token_lists):
        if ids:
            index = torch.tensor(ids, dtype=torch.int64)
            counts[row].index_add_(0, index, torch.ones(len(ids)))
    return counts


# Ranks sorted per row for top-k/top-p; a row whose kept tokens may reach past them is
# sorted in full. Sorting whole rows of a 49k vocabulary cost 137 ms per 64-row step.
TOP_HEAD = 1024


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, head_size: int = TOP_HEAD
) -> torch.Tensor:
    """`logits` with -inf outside each row's top-k, then outside its top-p nucleus (the
    smallest prefix of the ranking whose mass, renormalized over the top-k, reaches p)."""
    use_k = bool((top_k > 0).any())
    use_p = bool((top_p < 1).any())
    if not use_k and not use_p:
        return logits
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    values, order = logits.topk(min(head_size, vocab), dim=-1)  # sorted, descending
    keep, resolved = _kept_in_head(values, logits, k, top_p if use_p else None)
    out = torch.full_like(logits, float("-inf")).scatter_(-1, order, values.masked_fill(~keep, float("-inf")))
    unfiltered = (k == vocab) & (top_p >= 1)  # rows without either filter keep every token
    if bool(unfiltered.any()):
        rows = unfiltered.nonzero().squeeze(1)
        out[rows] = logits[rows]
        resolved = resolved | unfiltered
    if not bool(resolved.all()):
        rows = (~resolved).nonzero().squeeze(1)
        # a head as long as the row decides every row
        out[rows] = apply_top_k_top_p(logits[rows], top_k[rows], top_p[rows], head_size=vocab)
    return out


def _kept_in_head(
    values: torch.Tensor, logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the head's ranks each row keeps, and whether the head decides the row
    (every kept token is in it, and the top-p normalizer is known)."""
    head = values.shape[-1]
    keep = torch.arange(head).unsqueeze(0) < k.unsqueeze(1)
    k_in_head = k <= head
    if top_p is None:
        return keep, k_in_head
    no_k = k == logits.shape[-1]
    # softmax over the top-k: its normalizer is the head's (k in the head) or the row's (no k)
    head_norm = torch.logsumexp(values.masked_fill(~keep, float("-inf")), dim=-1)
    norm = torch.where(k_in_head, head_norm, torch.logsumexp(logits, dim=-1))
    probs = torch.exp(values - norm.unsqueeze(1)).masked_fill(~keep, 0.0)
    mass_before = probs.cumsum(dim=-1) - probs
    # keeps at least the top token; p = 1 cuts nothing (the mass may round to 1 early)
    cut = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    resolved = k_in_head | (no_k & cut.any(dim=-1))
    return keep & ~cut, resolved


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def gather_logprobs(
    raw_logprobs: torch.Tensor | None, tokens: list[int], num_logprobs: list[int | None]
) -> list[SampleLogprobs | None]:
    if raw_logprobs is None:
        return [None] * len(tokens)
    max_k = max(n or 0 for n in num_logprobs)
    best = raw_logprobs.topk(max_k, dim=-1) if max_k else None
    sampled = raw_logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
    result: list[SampleLogprobs | None] = []
    for row, n in enumerate(num_logprobs):
        if n is None:
            result.append(None)
            continue
        top = (
            list(zip(best.indices[row, :n].tolist(), best.values[row, :n].tolist()))
            if n and best is not None
            else []
        )
        result.append(SampleLogprobs(sampled=sampled[row], top=top))
    return result
