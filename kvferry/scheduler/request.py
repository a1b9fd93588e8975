"""A request as the scheduler sees it: tokens, progress, status and block hashes."""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Sequence
from types import MappingProxyType

from kvferry.errors import InvalidRequestError
from kvferry.messages.engine_core import EngineCoreRequest, FinishReason
from kvferry.messages.kv_connector import KVTransferParams
from kvferry.messages.model_runner import PromptLogprob
from kvferry.sampling_params import SamplingParams
from kvferry.scheduler.hashing import BlockHash, BlockHasher

logger = logging.getLogger(__name__)


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # blocks allocated, a connector is loading KV
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue, blocks freed, recomputes
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = MappingProxyType(
    {
        RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
        RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
        RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
        RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    }
)


def resolve_max_tokens(
    max_tokens: int | None, num_prompt_tokens: int, max_model_len: int, default_max_tokens: int | None = None
) -> int:
    """Output tokens allowed: the request's cap (``default_max_tokens`` when it sets none:
    ``--default-max-tokens``), and the model's context (at least one token). With neither,
    a request generates to the end of the context, as vLLM's do."""
    room = max(1, max_model_len - num_prompt_tokens)
    cap = default_max_tokens if max_tokens is None else max_tokens
    return room if cap is None else min(cap, room)


class Request:
    """Scheduler-side state of one request.

    `num_computed_tokens` counts tokens whose KV is (or, once the scheduled step ran, will
    be) in the request's blocks; the scheduler advances it when it schedules a step.
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        arrival_time: float = 0.0,
        kv_transfer_params: KVTransferParams | None = None,
        block_hasher: BlockHasher | None = None,
        default_max_tokens: int | None = None,
    ):
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt must contain at least one token", param="prompt")
        if len(prompt_token_ids) > max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens, more than the model's "
                f"context of {max_model_len}",
                param="prompt",
            )
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_tokens = resolve_max_tokens(
            sampling_params.max_tokens, len(prompt_token_ids), max_model_len, default_max_tokens
        )
        self.arrival_time = arrival_time
        self.kv_transfer_params = kv_transfer_params
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why the engine failed it (FINISHED_ERROR)
        self.invalid_param: str | None = None  # set when the error is the client's (HTTP 400)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled: prompt tokens served from a cache
        self.num_preemptions = 0
        self.forced_first_token_id: int | None = None  # see force_first_token
        self.prompt_logprobs: list[PromptLogprob] = []  # entry i: of prompt token i + 1
        self.block_hashes: list[BlockHash] = []
        # Speculative decoding (kvferry.scheduler.drafts): verified steps in a row whose
        # drafts all missed, and the output count before which none is proposed again.
        self.draft_misses = 0
        self.drafts_resume_at = 0
        self._block_hasher = block_hasher
        if block_hasher is not None:
            block_hasher.update(self)

    @classmethod
    def from_engine_core_request(
        cls,
        req: EngineCoreRequest,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        block_hasher: BlockHasher | None = None,
        default_max_tokens: int | None = None,
    ) -> Request:
        return cls(
            req.req_id,
            req.prompt_token_ids,
            req.sampling_params,
            eos_token_ids,
            max_model_len,
            arrival_time=req.arrival_time,
            kv_transfer_params=req.kv_transfer_params,
            block_hasher=block_hasher,
            default_max_tokens=default_max_tokens,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    @property
    def pending_forced_token_id(self) -> int | None:
        """The token the request's next sample must yield, while it has no output yet."""
        return None if self.output_token_ids else self.forced_first_token_id

    def force_first_token(self, token_id: int) -> None:
        """The first output token was already produced elsewhere (P/D: by the prefiller, and
        maybe already streamed to the client): the engine outputs it instead of its own sample.

        The token is still sampled, then replaced, so a seeded request consumes its one draw
        and later tokens match a run that sampled the token itself; logprobs come from this
        engine's logits. The caller checks the token is in the model's vocabulary.
        """
        assert not self.output_token_ids, f"{self} already has output"
        self.forced_first_token_id = token_id

    def attach_block_hasher(self, block_hasher: BlockHasher) -> None:
        """Hash with the scheduler's hasher (a request built without one has no hashes yet)."""
        if self._block_hasher is block_hasher:
            return
        assert not self.block_hashes, "a request's hashes come from one hasher"
        self._block_hasher = block_hasher
        block_hasher.update(self)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self._block_hasher.update(self)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
