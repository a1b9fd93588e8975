"""OpenAI request bodies (pydantic) and their translation to SamplingParams.

Fields follow OpenAI's API; the extras after ``# extras`` are kvferry's (as in vLLM).
Unknown fields are ignored. Types are strict (no "1" for 1, no 1.0 for a token id, no 1 for
true) and every integer fits int64 (what the engine's batch tensors hold); type errors
become HTTP 400 (see kvferry/entrypoints/edge.py). The P/D proxy validates with the same
models, so both refuse the same bodies.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvferry.entrypoints.openai.structured_protocol import StructuredOutputsFields
from kvferry.entrypoints.openai.tools import ToolsFields
from kvferry.errors import InvalidRequestError
from kvferry.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

if TYPE_CHECKING:
    from typing_extensions import TypeIs

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]  # the vocabulary's bound is the engine's check
# Lists stop at their first bad item. Without it pydantic reports every bad item, for each
# member of a union it tries: one bad id after 262,143 good ones cost 15 s of validation,
# holding the GIL; with it, 0.07 s (2026-11-27, 3c0034b, AMD EPYC, 2 vCPU, AVX2, loaded host).
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]
Texts = Annotated[list[str], Field(fail_fast=True)]
_STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _CommonRequest(StructuredOutputsFields):  # response_format, structured_outputs, guided_*
    model_config = _STRICT

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Texts | None = None
    seed: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # extras
    top_k: Int64 | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    # choices also carry token ids (the prompt's once, then the new ones)
    return_token_ids: bool = False
    best_of: Int64 | None = None
    min_tokens: Int64 = 0
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are: a string) -> bias
    allowed_token_ids: TokenIds | None = None
    bad_words: Texts | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            n=self.n,
            best_of=self.best_of,
            min_tokens=self.min_tokens,
            logit_bias=_token_biases(self.logit_bias),
            allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids),
            bad_words=list(self.bad_words or []),
            structured_outputs=self.structured_outputs_params(),
        )


def _token_biases(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as strings) with integer keys."""
    out = {}
    for key, value in (bias or {}).items():
        if not key.isdigit() or len(key) > 19:
            raise InvalidRequestError(f"logit_bias: {key!r:.40} is not a token id", param="logit_bias")
        out[int(key)] = value
    return out


Prompt = str | list[int]


def _is_token_ids(prompt: list[str] | list[int] | list[list[int]]) -> TypeIs[list[int]]:
    """One prompt's token ids, not a batch (a list holds one kind: pydantic checked it)."""
    return all(isinstance(x, int) for x in prompt)


class CompletionRequest(_CommonRequest):
    prompt: str | Texts | TokenIds | Annotated[list[TokenIds], Field(fail_fast=True)]
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: Int64 | None = None  # extra (vLLM's)

    def prompts(self) -> list[Prompt]:
        """The prompt as a batch: a string, a token list, or a list of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if _is_token_ids(p):
            return [list(p)]
        return [prompt for prompt in p]

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        params = self._sampling_params(max_tokens, self.logprobs)
        params.prompt_logprobs = self.prompt_logprobs
        params.validate()
        return params


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None = None
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        for key in ("tool_calls", "tool_call_id"):  # a conversation with tool calls and results
            if self.model_extra and key in self.model_extra:
                msg[key] = self.model_extra[key]
        return msg


class ChatCompletionRequest(ToolsFields, _CommonRequest):  # tools, tool_choice
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    # extras: the prompt as token ids, used instead of the messages' chat template (the P/D
    # proxy continues a chat answer on another decoder from the ids already sent)
    prompt_token_ids: TokenIds | None = Field(default=None, min_length=1)
    prompt_logprobs: Int64 | None = None  # vLLM's extra: the response's top-level prompt_logprobs

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = self._sampling_params(max_tokens, logprobs)  # None: up to the end of the context
        params.prompt_logprobs = self.prompt_logprobs
        params.validate()
        return params

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]


class KVReleaseRequest(BaseModel):
    """POST /v1/kv_transfer/release: the KV kept for this finished request's remote consumer
    (the prefill's ``remote_request_id``) will not be read: free it now."""

    model_config = _STRICT

    request_id: str = Field(min_length=1)
