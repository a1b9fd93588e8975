"""Results the offline API and the server hand to users."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.messages.kv_connector import KVTransferParams
from kvferry.messages.model_runner import SampleLogprobs


@dataclass(frozen=True)
class TokenLogprob:
    """vLLM's Logprob: a token's logprob, its rank (1: most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str


# Per prompt token: None for the first, then token id -> TokenLogprob (the prompt's token
# and the top-k alternatives), as vLLM's prompt_logprobs.
PromptLogprobsList = list[dict[int, TokenLogprob] | None]


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[SampleLogprobs] | None = None
    index: int = 0  # of the answer among its prompt's n


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Streaming: the text and tokens added by this update (the full ones are in outputs).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[SampleLogprobs] = field(default_factory=list)
    error: str | None = None
    invalid_param: str | None = None  # set when the error is the client's (HTTP 400)
    kv_transfer_params: KVTransferParams | None = None
    prompt_logprobs: PromptLogprobsList | None = None  # when asked (SamplingParams.prompt_logprobs)
