"""Front-end side of outputs: detokenize, apply stop strings, build RequestOutputs.

A streamed delta carries the tokens whose text it carries: while a token's bytes wait for
the rest of their character, or its text is held back for a forming stop string, the
token (and its logprobs) waits too. A consumer that continues an answer from the tokens it
was sent (the proxy's decode failover) then never loses text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvferry.engine.detokenizer import IncrementalDetokenizer
from kvferry.messages.engine_core import EngineCoreOutput, FinishReason
from kvferry.messages.model_runner import PromptLogprob, SampleLogprobs
from kvferry.outputs import CompletionOutput, PromptLogprobsList, RequestOutput, TokenLogprob
from kvferry.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_len: int = 0  # chars of text already sent to the client
    emitted_tokens: int = 0  # tokens already sent (their text is all in the first emitted_len)
    # (tokens, chars): after that many tokens the text is that long, no bytes pending.
    boundaries: list[tuple[int, int]] = field(default_factory=list)
    logprobs: list[SampleLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobsList | None = None

    @property
    def holdback(self) -> int:
        """Chars kept back while streaming: the start of a stop string may be forming."""
        return max((len(s) for s in self.params.stop), default=1) - 1


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)  # stop-string hits: abort in the core


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._states[request_id] = _RequestState(request_id, prompt, prompt_token_ids, params, detok)

    def abort_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        for out in outputs:
            state = self._states.get(out.req_id)
            if state is None:  # aborted or already finished by a stop string
                continue
            request_output, stopped = self._process_one(state, out)
            if stopped:
                result.reqs_to_abort.append(out.req_id)
            if request_output.finished:
                del self._states[out.req_id]
            result.request_outputs.append(request_output)
        return result

    def _process_one(self, state: _RequestState, out: EngineCoreOutput) -> tuple[RequestOutput, bool]:
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if out.num_prompt_tokens:
            state.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = prompt_logprobs_list(self.tokenizer, out.prompt_logprobs)
        new_tokens = list(out.new_token_ids)
        # The core stops only on tokens (EOS, stop_token_ids): such a token is not part of the text.
        text_tokens = new_tokens[:-1] if finish_reason == FinishReason.STOP else new_tokens
        state.text += state.detokenizer.step(text_tokens, final=out.finished)
        stopped_by_string = False
        past_min_tokens = len(state.token_ids) + len(new_tokens) > state.params.min_tokens  # as vLLM
        if state.params.stop and finish_reason in (None, FinishReason.LENGTH) and past_min_tokens:
            hit = self._find_stop_string(state)
            if hit is not None:
                finish_reason, stop_reason, stopped_by_string = FinishReason.STOP, hit, True
        state.token_ids.extend(new_tokens)
        state.logprobs.extend(out.new_logprobs)
        if not state.detokenizer.pending:
            state.boundaries.append((len(state.token_ids), len(state.text)))
        finished = finish_reason is not None
        return self._make_output(state, out, finish_reason, stop_reason, finished), stopped_by_string

    def _find_stop_string(self, state: _RequestState) -> str | None:
        """Search the freshly decoded tail for a stop string; truncate the text at it."""
        search_from = max(0, state.emitted_len - state.holdback)
        best: tuple[int, str] | None = None
        for stop in state.params.stop:
            idx = state.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        state.text = (
            state.text[: idx + len(stop)] if state.params.include_stop_str_in_output else state.text[:idx]
        )
        return stop

    @staticmethod
    def _sendable(state: _RequestState, finished: bool) -> tuple[int, int]:
        """(tokens, chars) the next delta may reach: the last token boundary whose text is
        not held back; everything once finished."""
        if finished:
            return len(state.token_ids), len(state.text)
        limit = len(state.text) - state.holdback
        reach = (state.emitted_tokens, state.emitted_len)
        while state.boundaries and state.boundaries[0][1] <= limit:  # boundaries only grow
            reach = state.boundaries.pop(0)
        return reach

    def _make_output(
        self,
        state: _RequestState,
        out: EngineCoreOutput,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        finished: bool,
    ) -> RequestOutput:
        tokens_end, visible = self._sendable(state, finished)
        delta_text = state.text[state.emitted_len : visible]
        delta_tokens = state.token_ids[state.emitted_tokens : tokens_end]
        delta_logprobs = state.logprobs[state.emitted_tokens : tokens_end]
        state.emitted_len, state.emitted_tokens = visible, tokens_end
        reason = finish_reason.value if finish_reason is not None else None
        completion = CompletionOutput(
            text=state.text[:visible],
            token_ids=list(state.token_ids),
            finish_reason=reason,
            stop_reason=stop_reason,
            logprobs=list(state.logprobs) if state.params.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
            delta_logprobs=delta_logprobs,
            error=out.error,
            invalid_param=out.invalid_param,
            kv_transfer_params=out.kv_transfer_params,
            prompt_logprobs=state.prompt_logprobs,
        )


def prompt_logprobs_list(
    tokenizer: PreTrainedTokenizerBase, entries: list[PromptLogprob]
) -> PromptLogprobsList:
    """vLLM's shape: None for the first prompt token, then per token its own logprob and
    the top-k alternatives', each with rank and text."""
    texts: dict[int, str] = {}

    def text(token: int) -> str:
        if token not in texts:
            texts[token] = str(tokenizer.decode([token]))
        return texts[token]

    result: PromptLogprobsList = [None]
    for entry in entries:
        ranked = {entry.token_id: TokenLogprob(entry.logprob, entry.rank, text(entry.token_id))}
        for rank, (token, logprob) in enumerate(entry.top, start=1):
            ranked.setdefault(token, TokenLogprob(logprob, rank, text(token)))
        result.append(ranked)
    return result
