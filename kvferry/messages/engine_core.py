"""Messages between the engine front end (API, offline LLM) and the engine core."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvferry.messages.kv_connector import KVTransferParams
from kvferry.messages.model_runner import PromptLogprob, SampleLogprobs
from kvferry.sampling_params import SamplingParams


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # client went away or asked to cancel
    ERROR = "error"  # the engine failed this request (e.g. KV load failure policy "fail")


@dataclass
class EngineCoreRequest:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    kv_transfer_params: KVTransferParams | None = None


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampleLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from a cache (not computed)
    error: str | None = None
    # Set (to the parameter's name, or "") when the error is the client's: HTTP 400, not 500.
    invalid_param: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    prompt_logprobs: list[PromptLogprob] | None = None  # with the first tokens, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
