"""Incremental detokenization that never splits a multi-byte character."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
PREFIX_CONTEXT_TOKENS = 5  # earlier tokens decoded with the new ones, so spacing is right


class IncrementalDetokenizer:
    """Decodes a growing token list into text deltas.

    Text of the new tokens is emitted only once it no longer ends with an incomplete
    UTF-8 sequence (decoded as U+FFFD); the bytes wait for the tokens that finish them.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-PREFIX_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    @property
    def pending(self) -> bool:
        """Whether some tokens' bytes wait for the tokens that finish their character."""
        return self.read_offset < len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        if not isinstance(text, str):  # a list: one text per sequence of a batch, not ours
            raise TypeError(f"the tokenizer decoded one sequence to {type(text).__name__}")
        return text

    def step(self, new_token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the text they complete (all of it when final)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if not final and full_text.endswith(REPLACEMENT_CHAR):
            return ""
        if len(full_text) <= len(prefix_text) or not full_text.startswith(prefix_text):
            # Decoding may merge across the boundary; fall back to the common prefix.
            common = _common_prefix_len(prefix_text, full_text)
            delta = full_text[common:]
        else:
            delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def streamed_text(
    tokenizer: PreTrainedTokenizerBase,
    context_ids: list[int],
    token_ids: list[int],
    skip_special_tokens: bool = True,
) -> str:
    """The text an output processor streams for ``token_ids`` generated after
    ``context_ids`` (the prompt), a token a step as an engine outputs them: the deltas of
    an ``IncrementalDetokenizer`` joined, bytes of an unfinished character left out."""
    detokenizer = IncrementalDetokenizer(tokenizer, context_ids, skip_special_tokens)
    return "".join(detokenizer.step([token_id]) for token_id in token_ids)
