"""The worker's side of structured outputs: compiled grammars, per-request matchers and the
batched token mask.

Grammars are compiled once per spec (the cache holds a fresh matcher per spec; a request
gets a copy, which costs no compilation). Each request's matcher advances with every
token the request outputs, a forced one included (a P/D decoder's first token is the
prefiller's), and over the outputs it already had when it (re)appears in a runner
(resumed after preemption). The mask of a step's rows is filled on one background thread,
started before the forward and collected before sampling: the fill runs while the forward
does (both release the GIL). Not llguidance's parallel executor: with it, 64 tokens of
SmolLM2 at batch 1 under a schema took 351 s against 116 s with this thread and 122 s
without a schema (2026-11-27, 2 vCPUs AVX2 shared with other jobs): its idle workers
take the forward's cores. A row without a grammar allows every token.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from kvferry.structured.params import StructuredOutputsParams, grammar_text

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


class GrammarCompileError(ValueError):
    """A spec that passed validation without a tokenizer but does not compile with the
    model's (a token the vocabulary lacks): the request's error, not the engine's."""


class RequestGrammar:
    """One request's position in its grammar."""

    def __init__(self, matcher: LLMatcher, req_id: str) -> None:
        self.matcher = matcher
        self.req_id = req_id

    def accept(self, token_id: int) -> None:
        """Advance over an output token; a token the grammar refuses (only a forced one can
        be) leaves the request unconstrained from here on, with an error in the log."""
        if self.matcher.is_error():
            return
        if not self.matcher.consume_token(token_id):
            logger.error(
                "request %s: token %d breaks its grammar (%s); it continues unconstrained",
                self.req_id,
                token_id,
                self.matcher.get_error(),
            )

    @property
    def constrains(self) -> bool:
        return not self.matcher.is_error()


class GrammarBackend:
    """Compiles grammars for one model's tokenizer and fills token masks for a batch."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance
        import llguidance.hf
        from transformers import PreTrainedTokenizerFast

        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise TypeError(f"structured outputs need a fast tokenizer, not {type(tokenizer).__name__}")
        self.vocab_size = vocab_size
        self._tokenizer: LLTokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._compiled: dict[StructuredOutputsParams, LLMatcher] = {}
        self._fill_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self.num_compiled = 0

    def new_request(
        self, req_id: str, spec: StructuredOutputsParams, token_ids: Sequence[int], num_prompt_tokens: int
    ) -> RequestGrammar:
        """A matcher for the request, advanced over the answer it already has: its outputs
        (resumed after preemption) after the prompt's resumed tail (a failover's)."""
        grammar = RequestGrammar(self._compiled_matcher(spec).deep_copy(), req_id)
        start = max(0, num_prompt_tokens - spec.resumed_output_tokens)
        for token in token_ids[start:]:
            grammar.accept(token)
        return grammar

    def _compiled_matcher(self, spec: StructuredOutputsParams) -> LLMatcher:
        from llguidance import LLMatcher

        matcher = self._compiled.get(spec)
        if matcher is None:
            try:
                matcher = LLMatcher(self._tokenizer, grammar_text(spec))
            except (ValueError, TypeError) as exc:
                raise GrammarCompileError(f"the {spec.kind.value} does not compile: {exc}") from exc
            if matcher.is_error():
                raise GrammarCompileError(
                    f"the {spec.kind.value} does not compile for this model: {matcher.get_error()}"
                )
            if len(self._compiled) >= MAX_CACHED_GRAMMARS:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[spec] = matcher
            self.num_compiled += 1
        return matcher

    def start_fill(self, grammars: Sequence[RequestGrammar | None]) -> Future[torch.Tensor] | None:
        """The packed mask (int32 [rows, vocab/32]) of a step's sampling rows, computed in the
        background; None when no row has an active grammar."""
        rows = [(g.matcher, i) for i, g in enumerate(grammars) if g is not None and g.constrains]
        if not rows:
            return None
        return self._fill_thread.submit(self._fill, rows, len(grammars))

    def _fill(self, rows: list[tuple[LLMatcher, int]], num_rows: int) -> torch.Tensor:
        import llguidance.torch

        bitmask = torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        for matcher, row in rows:  # one row at a time: a thread pool's spinning workers
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)  # slowed the forward 3x
        return bitmask

    def close(self) -> None:
        self._fill_thread.shutdown(wait=True)


# Bit b of byte value v, for every v: unpacks a mask a byte at a time (a lookup per byte
# instead of a shift per bit: 32 rows of a 49k vocabulary in ~1 ms instead of ~80 ms).
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with -inf where the packed mask's bit is 0 (bit j of word w: token 32w + j);
    tokens past the mask's end are refused."""
    assert sys.byteorder == "little", "the mask is unpacked from its bytes in memory order"
    rows, vocab = logits.shape
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # byte k of word w: tokens 32w + 8k ...
    allowed = _BYTE_BITS[as_bytes].reshape(rows, -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return logits.masked_fill(~allowed[:, :vocab].to(logits.device), float("-inf"))
