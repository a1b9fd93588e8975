"""What a model runner remembers about each request between steps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvferry.messages.scheduler_output import NewRequestData
from kvferry.sampling_params import SamplingParams
from kvferry.structured.backend import RequestGrammar
from kvferry.worker.logits_constraints import build_logits_constraints, uses_logits_constraints
from kvferry.worker.sampler import Penalties, SamplingBatch


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + sampled so far
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int
    forced_first_token_id: int | None = None  # the first sample yields this token
    grammar: RequestGrammar | None = None  # structured outputs: set by the model runner

    @classmethod
    def from_new(cls, data: NewRequestData) -> RequestState:
        return cls(
            req_id=data.req_id,
            token_ids=list(data.token_ids),
            num_prompt_tokens=data.num_prompt_tokens,
            params=data.sampling_params,
            block_ids=[list(ids) for ids in data.block_ids],
            num_computed_tokens=data.num_computed_tokens,
            forced_first_token_id=data.forced_token_id,
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def seed(self) -> int | None:
        """The seed of a sampled request's draws; None: greedy, or the engine's shared stream."""
        return None if self.params.greedy else self.params.seed

    @property
    def forced_token_id(self) -> int | None:
        """The token this step's sample must yield: the forced first one, before any output."""
        return None if len(self.token_ids) > self.num_prompt_tokens else self.forced_first_token_id


def build_sampling_batch(
    states: list[RequestState], eos_token_ids: Sequence[int] = (), offsets: Sequence[int] | None = None
) -> SamplingBatch:
    """One row per entry of `states` (a request with drafts has several); `offsets`: each
    row's position past its request's known tokens (None: all 0)."""
    params = [s.params for s in states]
    offsets = offsets or [0] * len(states)
    batch = SamplingBatch(
        temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
        seeds=[s.seed for s in states],
        positions=[len(s.token_ids) + j for s, j in zip(states, offsets)],  # where the sampled token goes
        num_logprobs=[p.logprobs for p in params],
    )
    # a forced token replaces a request's first sampled row, never a draft's
    forced = [s.forced_token_id if j == 0 else None for s, j in zip(states, offsets, strict=True)]
    if any(token is not None for token in forced):
        batch.forced_token_ids = forced
    if any(uses_logits_constraints(s.params, len(s.output_token_ids)) for s in states):
        outputs = [s.output_token_ids for s in states]
        batch.constraints = build_logits_constraints(params, outputs, eos_token_ids)
    if any(p.uses_penalties for p in params):
        batch.penalties = Penalties(
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] for s in states],
            output_token_ids=[s.output_token_ids for s in states],
        )
    return batch
