"""Which running requests get draft tokens this step, and which (kvferry.spec_decode).

A request is drafted for only where plain decoding's sample at each draft's position can
be computed from the logits alone, so the verifying step samples exactly as plain steps
would: no grammar, penalties or logits constraints (their state moves with every token),
min_tokens reached, and a first output token already there (a P/D decoder's first sample
is forced to the prefiller's token, which is then itself a draft: `forced_draft`).

Drafts that are not kept cost a verifying step more rows than plain decoding's. A request
whose drafts all missed waits before it is drafted for again: 1 output token after the
first miss in a row, then 2, 4, up to `MAX_BACKOFF_TOKENS`; a kept draft ends the wait.
Answers that never repeat their context then pay for few verifications, and answers that
do are drafted for at every step (measured on SmolLM2, docs/benchmarks.md, "Speculative
decoding").
"""

from __future__ import annotations

from kvferry.scheduler.request import Request
from kvferry.spec_decode.config import SpeculativeConfig, SpeculativeMethod
from kvferry.spec_decode.ngram import propose_ngram

MAX_BACKOFF_TOKENS = 16


def can_speculate(request: Request) -> bool:
    params = request.sampling_params
    return (
        request.num_output_tokens > 0
        and request.num_output_tokens >= params.min_tokens
        and params.structured_outputs is None
        and not params.uses_penalties
        and not params.uses_logits_constraints
    )


def forced_draft(request: Request) -> list[int]:
    """The forced first token (P/D: the prefiller's) as a draft of the step that computes the
    prompt's end, or nothing. Its row is sampled as the forced token, so the draft is always
    kept, and the row after it gives the second token in the same step: a P/D decoder then
    needs one step, not two, for its first token of its own. The same conditions as drafting
    (the second token's sample must need only its logits), and no prompt logprobs."""
    params = request.sampling_params
    token = request.pending_forced_token_id
    if (
        token is None
        or request.max_tokens < 2
        or params.min_tokens > 1
        or params.prompt_logprobs is not None
        or params.structured_outputs is not None
        or params.uses_penalties
        or params.uses_logits_constraints
    ):
        return []
    return [token]


class DraftProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        assert config.method is SpeculativeMethod.NGRAM, f"no proposer for {config.method}"
        self.config = config
        self.max_model_len = max_model_len
        self.num_draft_tokens = 0  # proposed and verified, since start
        self.num_accepted_tokens = 0  # of those, kept

    def active(self, num_running: int) -> bool:
        """Whether a step with `num_running` requests drafts at all."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    def propose(self, request: Request, token_budget: int) -> list[int]:
        """Drafts for a decoding request: at most what the step's budget, the request's
        max_tokens and the model's context leave room for (the step also yields one
        sampled token past the kept drafts)."""
        if not can_speculate(request) or request.num_output_tokens < request.drafts_resume_at:
            return []
        room = min(
            self.config.num_speculative_tokens,
            token_budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        if room < 1:
            return []
        return propose_ngram(
            request.all_token_ids, room, self.config.prompt_lookup_min, self.config.prompt_lookup_max
        )

    def record(self, request: Request, num_drafts: int, num_kept: int) -> None:
        """A verified step's outcome, before its tokens are appended to `request`."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_kept
        if num_kept:
            request.draft_misses = 0
            return
        wait = min(MAX_BACKOFF_TOKENS, 1 << request.draft_misses)
        request.draft_misses += 1
        request.drafts_resume_at = request.num_output_tokens + 1 + wait
