"""What the scheduler hands the executor each step: the scheduled requests, their block ids
and the connector's metadata (a message: the scheduler builds it, the executor, workers and
connectors read it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.kv.pages import PageChanges
from kvferry.sampling_params import SamplingParams

# One list of block ids per KV cache group.
BlockIds = tuple[list[int], ...]


@dataclass
class NewRequestData:
    """A request the workers have not seen (or lost: resumed after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far (outputs are non-empty only when resumed)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: BlockIds
    num_computed_tokens: int  # tokens whose KV is already in the blocks (prefix hits)
    forced_token_id: int | None = None  # its first sample yields this (Request.force_first_token)


@dataclass
class CachedRequestData:
    """Requests the workers already hold, with what changed since the last step."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[BlockIds | None] = field(default_factory=list)  # appended to tables
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished or aborted since last step: workers drop their state
    preempted_req_ids: set[str]  # workers drop their state; the request comes back as new
    kv_connector_metadata: object | None = None
    # Elastic KV memory: pages workers map before this step and return (kvferry.kv.pages).
    kv_pages: PageChanges | None = None
    # Speculative decoding: req_id -> draft tokens past its last token, included in its
    # num_scheduled_tokens; the step verifies them (kvferry.spec_decode.verify).
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> SchedulerOutput:
        """The output of a step with nothing to run (dummy runs build metadata from this)."""
        return cls([], CachedRequestData(), {}, 0, set(), set())

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
