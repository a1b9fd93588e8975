"""Workloads of ``kvferry bench goodput``: token-id prompts, pure functions of their seed.

- ``random``: independent random prompts of ``input_len`` tokens (no shared prefix).
- ``shared-prefix``: ``num_system`` system prompts of ``system_len`` tokens, each used by
  ``users_per_system`` users; a user's conversation has ``turns`` turns, each prompt being
  the previous one plus a reply and a new user message (``turn_len`` tokens), so turn k+1
  extends turn k's prompt. Requests are ordered turn by turn (every conversation's turn 1,
  then every turn 2, ...) so a turn is sent after the one it extends.
- ``multi-turn``: the same conversations, but each opens with its own first message of
  ``system_len`` tokens (nothing shared between conversations): only a conversation's
  earlier turns are reusable, so a router must send each turn where the previous one went.

Token ids are drawn from ``[low_id, vocab_size)`` (ids below ``low_id`` are left out: they
hold a tokenizer's special tokens), so every deployment gets the same ids.
"""

from __future__ import annotations

import enum
import logging
import random
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class WorkloadKind(enum.Enum):
    RANDOM = "random"
    SHARED_PREFIX = "shared-prefix"
    MULTI_TURN = "multi-turn"


@dataclass(frozen=True)
class WorkloadSpec:
    kind: WorkloadKind
    num_requests: int  # random: prompts; shared-prefix: at most this many (whole turns first)
    input_len: int = 512  # random: prompt tokens
    num_system: int = 2
    users_per_system: int = 2
    system_len: int = 256
    turn_len: int = 32
    turns: int = 2
    vocab_size: int = 32000
    low_id: int = 100

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be at least 1, not {self.num_requests}")
        if self.vocab_size <= self.low_id:
            raise ValueError(f"vocab_size {self.vocab_size} must exceed low_id {self.low_id}")
        sizes = {
            "input_len": self.input_len,
            "num_system": self.num_system,
            "users_per_system": self.users_per_system,
            "system_len": self.system_len,
            "turn_len": self.turn_len,
            "turns": self.turns,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")


@dataclass(frozen=True)
class WorkloadRequest:
    prompt: tuple[int, ...]
    group: str  # the system prompt (shared-prefix) or the request itself (random)
    conversation: int  # -1 for random prompts
    turn: int  # 0-based


def _tokens(rng: random.Random, spec: WorkloadSpec, count: int) -> list[int]:
    return [rng.randrange(spec.low_id, spec.vocab_size) for _ in range(count)]


def random_prompts(spec: WorkloadSpec, seed: int) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    return [
        WorkloadRequest(tuple(_tokens(rng, spec, spec.input_len)), f"r{i}", -1, 0)
        for i in range(spec.num_requests)
    ]


def shared_prefix_prompts(spec: WorkloadSpec, seed: int, shared: bool = True) -> list[WorkloadRequest]:
    """Conversations turn by turn; ``shared``: users of a system prompt share it, else each
    conversation opens with its own (multi-turn)."""
    rng = random.Random(seed)
    num_users = spec.num_system * spec.users_per_system
    systems = [_tokens(rng, spec, spec.system_len) for _ in range(spec.num_system if shared else num_users)]
    owners = [s for s in range(spec.num_system) for _ in range(spec.users_per_system)]
    conversations = [
        (owner if shared else user, list(systems[owner if shared else user]))
        for user, owner in enumerate(owners)
    ]
    rng.shuffle(conversations)  # users of one system prompt arrive interleaved with others'
    requests: list[WorkloadRequest] = []
    for turn in range(spec.turns):
        for index, (system, history) in enumerate(conversations):
            history.extend(_tokens(rng, spec, spec.turn_len))  # (a reply and) the user's message
            requests.append(WorkloadRequest(tuple(history), f"s{system}", index, turn))
    return requests[: spec.num_requests]


def make_workload(spec: WorkloadSpec, seed: int) -> list[WorkloadRequest]:
    if spec.kind is WorkloadKind.RANDOM:
        return random_prompts(spec, seed)
    return shared_prefix_prompts(spec, seed, shared=spec.kind is WorkloadKind.SHARED_PREFIX)


def poisson_gaps(num: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request (the first at 0); all 0 for an infinite rate."""
    rng = random.Random(seed)
    if rate == float("inf"):
        return [0.0] * num
    return [0.0] + [rng.expovariate(rate) for _ in range(num - 1)]
