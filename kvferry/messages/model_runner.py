"""What a worker's model runner returns for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.messages.kv_connector import KVConnectorOutput


@dataclass
class SampleLogprobs:
    """Logprob of the sampled token and the top-k alternatives (token id -> logprob)."""

    sampled: float
    top: list[tuple[int, float]]


@dataclass
class PromptLogprob:
    """A prompt token's logprob given the tokens before it, its rank in the distribution
    (1: the most likely) and the top-k alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class PromptLogprobs:
    """Prompt logprobs computed in one step: those of the prompt tokens at positions
    ``first + 1``, ``first + 2``, ... (the first prompt token has none)."""

    first: int
    entries: list[PromptLogprob]


@dataclass(frozen=True)
class RequestFailure:
    """Why the worker failed one request of a step (the step and its other requests go on):
    a grammar that does not compile for the model, constraints that refuse every token."""

    message: str
    param: str | None = None  # the request field at fault (the client's error: HTTP 400)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str] = field(default_factory=list)
    # Per request, in req_ids order: the tokens sampled this step (empty for a prefill chunk
    # that has not reached the end of the prompt; with drafts, the kept ones and one more).
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[SampleLogprobs] | None] = field(default_factory=list)  # one per sampled token
    kv_connector_output: KVConnectorOutput | None = None  # this worker's; aggregated by the executor
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # req id -> this step's
    failed: dict[str, RequestFailure] = field(default_factory=dict)  # req id -> why; its tokens void

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls()
