"""Validation of the sampling parameters vLLM adds to OpenAI's: n, best_of, min_tokens,
logit_bias, allowed_token_ids, bad_words and prompt_logprobs (vLLM's ranges and rules).

Bounds that need the model (token ids inside its vocabulary) are the input processor's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvferry.errors import InvalidRequestError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_N = 128  # answers (n, best_of) one request may ask for: each is an engine request
MAX_PROMPT_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: [-100, 100]
_INT64_MAX = 2**63 - 1


class ConstrainedParams(Protocol):
    """The fields of SamplingParams checked here (sampling_params sits above this module)."""

    n: int
    best_of: int | None
    max_tokens: int | None
    min_tokens: int
    logit_bias: dict[int, float]
    allowed_token_ids: list[int] | None
    bad_words: list[str]
    bad_words_token_ids: list[list[int]]
    prompt_logprobs: int | None
    stop_token_ids: list[int]
    ignore_eos: bool


def _is_int(value: object, low: int = 0, high: int = _INT64_MAX) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


def validate_constraint_params(params: ConstrainedParams) -> None:
    _check(_is_int(params.n, 1, MAX_N), f"n must be an integer in [1, {MAX_N}]", "n")
    best_of = params.best_of
    _check(
        best_of is None or _is_int(best_of, params.n, MAX_N),
        f"best_of must be an integer in [n, {MAX_N}] (n is {params.n})",
        "best_of",
    )
    _check(_is_int(params.min_tokens), "min_tokens must be a non-negative integer", "min_tokens")
    _check(
        params.max_tokens is None or params.min_tokens <= params.max_tokens,
        f"min_tokens ({params.min_tokens}) must be at most max_tokens ({params.max_tokens})",
        "min_tokens",
    )
    _validate_logit_bias(params.logit_bias)
    allowed = params.allowed_token_ids
    _check(
        allowed is None or (bool(allowed) and all(_is_int(t) for t in allowed)),
        "allowed_token_ids must be a non-empty list of non-negative token ids",
        "allowed_token_ids",
    )
    _check(
        isinstance(params.bad_words, list) and all(isinstance(w, str) and w for w in params.bad_words),
        "bad_words must be non-empty strings",
        "bad_words",
    )
    _check(
        all(ids and all(_is_int(t) for t in ids) for ids in params.bad_words_token_ids),
        "bad words must tokenize to non-empty lists of token ids",
        "bad_words",
    )
    _check(
        params.prompt_logprobs is None or _is_int(params.prompt_logprobs, 0, MAX_PROMPT_LOGPROBS),
        f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}]",
        "prompt_logprobs",
    )


def _validate_logit_bias(bias: dict[int, float]) -> None:
    _check(isinstance(bias, dict), "logit_bias must map token ids to biases", "logit_bias")
    for token, value in bias.items():
        _check(_is_int(token), f"logit_bias: bad token id {token!r}", "logit_bias")
        finite = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        _check(
            finite and -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT,
            f"logit_bias: the bias of token {token} must be in [-100, 100]",
            "logit_bias",
        )


def check_token_ids_in_vocab(params: ConstrainedParams, vocab_size: int) -> None:
    """Every token id the constraints name is inside the model's vocabulary."""
    named = {
        "logit_bias": list(params.logit_bias),
        "allowed_token_ids": params.allowed_token_ids or [],
        "bad_words": [t for ids in params.bad_words_token_ids for t in ids],
    }
    for name, ids in named.items():
        _check(all(t < vocab_size for t in ids), f"{name}: token ids must be in [0, {vocab_size})", name)


def check_some_token_allowed(params: ConstrainedParams, eos_token_ids: Sequence[int]) -> None:
    """``allowed_token_ids`` leave a token to sample: not only single-token bad words, nor,
    while min_tokens holds them back, only stop tokens (vLLM would sample a masked row)."""
    allowed = params.allowed_token_ids
    if not allowed:
        return
    banned = {ids[0] for ids in params.bad_words_token_ids if len(ids) == 1}
    _check(
        not set(allowed) <= banned,
        "allowed_token_ids: every allowed token is a bad word",
        "allowed_token_ids",
    )
    if params.min_tokens > 0:
        stops = banned | set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        _check(
            not set(allowed) <= stops,
            f"min_tokens ({params.min_tokens}) cannot be met: allowed_token_ids holds only stop "
            "tokens (EOS, stop_token_ids) and bad words",
            "min_tokens",
        )


def tokenize_bad_words(tokenizer: PreTrainedTokenizerBase, words: list[str]) -> list[list[int]]:
    """Each bad word's tokens as written and, where it tokenizes to a different first token
    of the same length, after a space (a word inside a sentence), as vLLM does."""
    result: list[list[int]] = []
    for word in words:
        bare: list[int] = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced: list[int] = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if bare:
            result.append(bare)
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            result.append(spaced)
    return result
