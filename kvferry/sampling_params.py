"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvferry.constraint_params import validate_constraint_params
from kvferry.errors import InvalidRequestError
from kvferry.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what the engine's batch tensors hold
FLOAT32_TINY, FLOAT32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38  # smallest normal, largest


def child_seed(seed: int, index: int) -> int:
    """The seed of answer ``index`` of a request seeded ``seed`` (n > 1: seed + index, as
    vLLM), wrapped inside int64 as the batch tensors hold it."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives; 0 = only the sampled token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's extras (validated in constraint_params.py; applied by worker/logits_constraints.py)
    n: int = 1  # answers returned per prompt
    best_of: int | None = None  # answers generated (>= n): the n of highest cumulative logprob kept
    min_tokens: int = 0  # EOS and stop tokens masked (stop strings ignored) until this many outputs
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] = field(default_factory=list)  # never generated (multi-token: last token)
    prompt_logprobs: int | None = None  # top alternatives per prompt token (LLM, completions)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # set by the input processor
    structured_outputs: StructuredOutputsParams | None = None  # kvferry/structured/

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        self._validate_ints()
        self._validate_floats()
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1", "max_tokens")
        _check(self.temperature >= 0, "temperature must be non-negative", "temperature")
        _check(0 < self.top_p <= 1, "top_p must be in (0, 1]", "top_p")
        _check(self.top_k >= 0, "top_k must be -1 (disabled) or positive", "top_k")
        _check(0 <= self.min_p <= 1, "min_p must be in [0, 1]", "min_p")
        _check(self.repetition_penalty > 0, "repetition_penalty must be positive", "repetition_penalty")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]", "presence_penalty")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]", "frequency_penalty")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs must be in [0, {MAX_LOGPROBS}]",
            "logprobs",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings", "stop")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "bad stop_token_ids",
            "stop_token_ids",
        )
        validate_constraint_params(self)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()

    def _validate_floats(self) -> None:
        """Floats are finite and survive float32 (the batch tensors): a positive top_p or
        repetition_penalty must not round to 0, a temperature must not overflow."""
        floats = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        for name, value in floats.items():
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            _check(ok and abs(value) <= FLOAT32_MAX, f"{name} must be finite, at most {FLOAT32_MAX:g}", name)
        for name in ("top_p", "repetition_penalty"):
            _check(floats[name] >= FLOAT32_TINY, f"{name} is too small (at least {FLOAT32_TINY:g})", name)

    def _validate_ints(self) -> None:
        """Integers are ints (not bools) within int64: a batch tensor must hold every one."""
        ints = {
            "max_tokens": self.max_tokens,
            "top_k": self.top_k,
            "seed": self.seed,
            "logprobs": self.logprobs,
        }
        for name, value in ints.items():
            _check(value is None or _is_int64(value), f"{name} must be a 64-bit integer", name)
        _check(all(_is_int64(t) for t in self.stop_token_ids), "bad stop_token_ids", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_logits_constraints(self) -> bool:
        """Whether the sampler masks or biases this request's logits (min_tokens aside)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _is_int64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)
