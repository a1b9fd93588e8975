"""--speculative-config: how the engine proposes draft tokens (vLLM's keys).

Speculation is exact: a draft token is kept only when the engine's own sample at its
position equals it (kvferry.spec_decode.verify), so greedy answers, and seeded ones (their
draws are keyed by position), are the tokens plain decoding gives, in fewer steps.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum

from kvferry.errors import ConfigError
from kvferry.json_flags import json_object, parse_json_flag


class SpeculativeMethod(str, Enum):
    """Where draft tokens come from."""

    NGRAM = "ngram"  # prompt lookup: the tokens that followed the sequence's last n-gram before

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method` None: off (the default). `num_speculative_tokens`: drafts per request and
    step. The n-gram proposer matches the last `prompt_lookup_max` down to
    `prompt_lookup_min` tokens. `disable_by_batch_size`: no drafts in a step while at least
    this many requests run (None: at any batch size); drafts cost compute, which a large
    batch no longer has to spare."""

    method: SpeculativeMethod | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            return
        try:
            object.__setattr__(self, "method", SpeculativeMethod(self.method))
        except ValueError:
            choices = ", ".join(m.value for m in SpeculativeMethod)
            raise ConfigError(
                f"--speculative-config: unknown method {self.method!r}; choose {choices}"
            ) from None
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        _positive("prompt_lookup_max", self.prompt_lookup_max)
        _positive("prompt_lookup_min", self.prompt_lookup_min)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError("--speculative-config: prompt_lookup_min is above prompt_lookup_max")
        if self.disable_by_batch_size is not None:
            _positive("disable_by_batch_size", self.disable_by_batch_size)

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def from_value(cls, raw: SpeculativeConfig | dict[str, object] | str | None) -> SpeculativeConfig:
        """The config of `LLM(speculative_config=...)` (a dict or this) or of the flag (JSON)."""
        if raw is None:
            return cls()
        if isinstance(raw, SpeculativeConfig):
            return raw
        flag = "--speculative-config"
        data = json_object(
            parse_json_flag(raw, flag) if isinstance(raw, str) else raw, flag, [f.name for f in fields(cls)]
        )
        if data.get("method") is None:
            raise ConfigError(f'{flag}: say which method ("ngram")')
        return cls(**data)


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"--speculative-config: {name} must be a positive integer, not {value!r}")
