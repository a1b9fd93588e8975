"""Decode failover: a decoder that dies during a leg does not end the client's answer.

The answer is continued on another decode instance as a colocated-style request (no
``kv_transfer_params``: that decoder recomputes the prompt itself). A fresh prefill leg
is not used: it would add a second transfer and a second instance to fail, and what
matters for the answer is only that the new decoder sees the same tokens.

Non-streamed, nothing has reached the client: the original request is sent again.
Streamed, the client already has some text: the decode request asks for token ids
(``return_token_ids``), so the proxy knows the prompt's and the sent tokens' ids (a
streamed delta carries exactly the tokens whose text it carries, engine/output_processor.py:
a token whose bytes or text were still held back is not among them), and the
continuation's prompt is those ids, not re-tokenized text (text does not always tokenize
back into the same ids): a completion's ``prompt``, a chat request's ``prompt_token_ids``
(the chat template's output plus the sent tokens, used instead of the messages; the
answer stays a chat stream, its repeated role chunk dropped). ``max_tokens`` (and chat's
``max_completion_tokens``) shrinks by the tokens already sent, and usage is corrected to
count them as completion tokens; ``resumed_output_tokens`` tells the new decoder how
many of the prompt's tokens are the answer so far, so a structured-output grammar resumes
after them instead of starting over (docs/structured.md), and so does a streamed answer's
tool-call parse (openai/answer_calls.py): the continuation's ``tool_calls`` deltas extend
the calls the client has, under their ids, and the proxy passes them through. A greedy answer is then
byte-identical to an undisturbed one, and so is a seeded sampled one: an engine's seeded draw for a token is keyed by the
seed and the token's position in the sequence (kvferry/worker/seeded_draws.py), so the
new decoder draws what the lost one would have. (Unseeded sampled answers continue
coherently but are not reproducible anyway. Presence and frequency penalties count only
output tokens, so with those the continuation sees the sent tokens as prompt.)

With n > 1 the decoder streams n answers (choices); the proxy keeps each one's sent ids
(``SentChoices``). When the decoder is lost, every choice that has not finished continues
on another decoder as its own n = 1 request: its prompt plus its sent ids, its own
``resumed_output_tokens`` and shrunk ``max_tokens``, and its own seed, the request's seed
+ its index, as the decoder seeded that answer (engine/parallel_sampling.py), so a seeded
choice continues byte-identically too. A choice that sent nothing yet starts over as that
answer alone. The continuations' chunks are re-indexed to their choice, and their usage
chunks combined into the leg's: the prompt once, every answer's completion tokens.

Counted in the proxy's /metrics: ``kvferry_proxy:decode_failovers{mode}`` for an answer a
decoder had accepted and was lost during (mode ``stream`` or ``complete``), and
``kvferry_proxy:requests_moved{role="decode", cause}`` for a request no decoder accepted
yet: the chosen one refused the connection (``refused``) or was lost before its answer's
status line (``lost``), and the request went whole to another decoder (upstream.py).
"""

from __future__ import annotations

import copy
from typing import Any

from kvferry.entrypoints.proxy.errors import UpstreamTimeoutError, UpstreamUnavailableError
from kvferry.sampling_params import child_seed

# What a dead or hung decoder raises; another decoder may still answer.
DECODER_LOST = (UpstreamUnavailableError, UpstreamTimeoutError)
TOKEN_ID_FIELDS = ("token_ids", "prompt_token_ids")


class SentTokens:
    """The token ids of one leg's answer that a decoder already streamed."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.prompt: list[int] | None = None
        self.generated: list[int] = []
        self.resumed_after = 0  # tokens sent before the current decoder took over
        self.finished = False  # the answer's last chunk (its finish_reason) was sent

    def record(self, chunk: dict[str, Any], keep_ids: bool) -> None:
        """Note the chunk's ids; drop them from it unless the client asked for them."""
        for choice in chunk.get("choices") or []:
            self.record_choice(choice, keep_ids)

    def record_choice(self, choice: dict[str, Any], keep_ids: bool) -> None:
        """``record`` for one choice of a chunk (this answer's)."""
        prompt = choice.get("prompt_token_ids")
        if self.prompt is None and isinstance(prompt, list):
            self.prompt = list(prompt)  # a later decoder's (longer) prompt is not kept
        self.generated.extend(choice.get("token_ids") or [])
        self.finished = self.finished or choice.get("finish_reason") is not None
        if not keep_ids:
            for name in TOKEN_ID_FIELDS:
                choice.pop(name, None)
        elif self.resumed_after:
            choice.pop("prompt_token_ids", None)  # the client got the real prompt's already

    def resume_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request that continues the answer on another decoder."""
        out = copy.deepcopy(body)
        out.pop("kv_transfer_params", None)
        out["return_token_ids"] = True
        if self.prompt is None:  # the lost decoder sent nothing: start over
            return out
        out.pop("prompt_logprobs", None)  # the client has them (a choice's first chunk)
        out["prompt_token_ids" if self.chat else "prompt"] = self.prompt + self.generated
        for name in ("max_tokens", "max_completion_tokens") if self.chat else ("max_tokens",):
            if isinstance(out.get(name), int):
                out[name] = max(1, out[name] - len(self.generated))
        out["resumed_output_tokens"] = self.resumed_after = len(self.generated)  # a grammar resumes there
        return out

    def fix_usage(self, chunk: dict[str, Any]) -> None:
        """Count tokens sent before a failover as completion tokens, not the prompt's."""
        usage = chunk.get("usage")
        if not self.resumed_after or not isinstance(usage, dict):
            return
        usage["prompt_tokens"] = usage.get("prompt_tokens", 0) - self.resumed_after
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.resumed_after


class SentChoices:
    """The sent tokens of each of a leg's n answers (choices), by the leg's choice index.

    A decoder lost during an n > 1 stream is replaced by one continuation per unfinished
    choice, each an n = 1 request of its own: the choice's prompt and sent ids, its own seed
    (the request's seed + index, as the decoder seeded that answer: parallel_sampling.py),
    so a seeded answer continues with the draws it would have had."""

    def __init__(self, chat: bool, answers: int) -> None:
        self.choices = [SentTokens(chat) for _ in range(answers)]

    def record(self, chunk: dict[str, Any], keep_ids: bool) -> None:
        """``SentTokens.record`` for each choice of ``chunk`` (indexed as the leg's)."""
        for choice in chunk.get("choices") or []:
            self.choices[choice.get("index", 0)].record_choice(choice, keep_ids)

    def unfinished(self, indices: list[int]) -> list[int]:
        return [i for i in indices if not self.choices[i].finished]

    def resume_body(self, body: dict[str, Any], index: int) -> dict[str, Any]:
        """The n = 1 request that continues answer ``index`` on another decoder."""
        out = self.choices[index].resume_body(body)
        out.pop("n", None)
        out.pop("best_of", None)
        seed = out.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool):
            out["seed"] = child_seed(seed, index)
        return out

    def leg_usage(self, resumed: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
        """The leg's usage after a failover, from each continuation's usage (by choice,
        corrected by ``fix_usage``): the prompt once, as a colocated server counts it, and
        every answer's completion tokens (a choice that ended before the failover: its
        sent ids). None without any continuation's usage (the client did not ask for it)."""
        if not resumed:
            return None
        first = resumed[min(resumed)]
        completion = sum(
            resumed[i].get("completion_tokens", 0) if i in resumed else len(sent.generated)
            for i, sent in enumerate(self.choices)
        )
        prompt = first.get("prompt_tokens", 0)
        usage = {**first, "prompt_tokens": prompt, "completion_tokens": completion}
        usage["total_tokens"] = prompt + completion
        details = first.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            # the continuation's cached tokens are of its prompt plus the sent tokens
            usage["prompt_tokens_details"] = {
                **details,
                "cached_tokens": min(details["cached_tokens"], prompt),
            }
        return usage


def is_role_chunk(chunk: dict[str, Any]) -> bool:
    """A chat stream's opening chunk: the assistant's role, no content, ids or end yet."""
    choices = chunk.get("choices") or []
    return bool(choices) and all(_opens_the_role(choice) for choice in choices)


def _opens_the_role(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    return (
        bool(delta.get("role"))
        and not delta.get("content")
        and choice.get("finish_reason") is None
        and not choice.get("token_ids")
    )
