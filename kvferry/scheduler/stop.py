"""Stop checks on sampled tokens: EOS, stop token ids, max_tokens and the model's context.

Stop strings need text, so the front end handles them (and aborts the request).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvferry.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def check_stop(request: Request, max_model_len: int) -> bool:
    """Whether the request's last token ends it; if so, sets its status and stop_reason."""
    last = request.output_token_ids[-1]
    params = request.sampling_params
    # Below min_tokens the sampler holds EOS and stop tokens back, unless a complete grammar
    # allows nothing else (kvferry/worker/sampler.py): one sampled there ends the request.
    if not params.ignore_eos and last in request.eos_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    return _length_capped(request, max_model_len)


def _length_capped(request: Request, max_model_len: int) -> bool:
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def append_sampled(request: Request, sampled: Sequence[int], max_model_len: int) -> list[int]:
    """Append sampled tokens until one stops the request; returns the tokens kept."""
    kept: list[int] = []
    for token in sampled:
        request.append_output_token_ids(token)
        kept.append(token)
        if check_stop(request, max_model_len):
            break
    return kept
