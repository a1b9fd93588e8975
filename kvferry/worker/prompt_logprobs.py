"""Prompt logprobs (vLLM's ``prompt_logprobs``): for a request that asks, the logits of
every prompt position computed this step give the next prompt token's logprob, its rank
and the top-k alternatives. Such a request skips the prefix cache (as in vLLM), so every
prompt position is computed, chunk by chunk."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvferry.messages.model_runner import PromptLogprob, PromptLogprobs
from kvferry.worker.inputs import RowSpan

logger = logging.getLogger(__name__)


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    spans: list[RowSpan],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, PromptLogprobs]:
    """Per asking request, the prompt logprobs of this step's rows (``hidden`` holds every
    row of the step; ``spans`` say whose they are; states not yet advanced). A request's
    prompt rows are one span (a recomputed request's generated rows, another, have none)."""
    result: dict[str, PromptLogprobs] = {}
    for span in spans:
        state, start = span.state, span.start
        k = state.params.prompt_logprobs
        # rows whose next token is a prompt token: positions start .. last
        last = min(start + span.length, state.num_prompt_tokens - 1)
        if k is not None and last > start:
            rows = hidden[span.first_row : span.first_row + last - start]
            targets = state.token_ids[start + 1 : last + 1]
            result[state.req_id] = PromptLogprobs(start, _entries(compute_logits(rows), targets, k))
    return result


def _entries(logits: torch.Tensor, targets: list[int], k: int) -> list[PromptLogprob]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.int64, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, index)
    ranks = (logprobs > chosen).sum(dim=-1).add(1).tolist()
    chosen_list = chosen.squeeze(1).tolist()
    top = logprobs.topk(k, dim=-1) if k else None
    entries = []
    for i, token in enumerate(targets):
        alternatives = (
            list(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True)) if top is not None else []
        )
        entries.append(PromptLogprob(token, chosen_list[i], ranks[i], alternatives))
    return entries
