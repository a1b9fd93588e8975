"""What one schedule() call decided, gathered while it runs, then turned into a SchedulerOutput."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvferry.messages.scheduler_output import BlockIds, CachedRequestData, NewRequestData, SchedulerOutput
from kvferry.scheduler.kv_cache_manager import KVCacheManager
from kvferry.scheduler.request import Request

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    token_budget: int
    # Prompt tokens (chunks of more than one token) this step may still take: capped while
    # requests decode (SchedulerConfig.prefill_budget_with_decodes); None: no cap.
    prefill_room: int | None = None
    new_reqs: list[Request] = field(default_factory=list)  # first scheduled, or resumed
    running_reqs: list[Request] = field(default_factory=list)  # already known to the workers
    new_block_ids: dict[str, BlockIds] = field(default_factory=dict)  # of running_reqs
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts, by request
    num_preempted: int = 0

    def add_running(
        self, request: Request, num_tokens: int, new_block_ids: BlockIds, drafts: list[int] | None = None
    ) -> None:
        """`drafts`: tokens proposed past the request's last one, counted in `num_tokens`
        (they are not prompt tokens: the step's prefill room does not pay for them)."""
        self.running_reqs.append(request)
        self.new_block_ids[request.req_id] = new_block_ids
        if drafts:
            self.spec_token_ids[request.req_id] = drafts
        self._take(request, num_tokens)

    def add_new(self, request: Request, num_tokens: int, drafts: list[int] | None = None) -> None:
        """`drafts`: as for add_running (a new request's: its forced first token)."""
        self.new_reqs.append(request)
        if drafts:
            self.spec_token_ids[request.req_id] = drafts
        self._take(request, num_tokens)

    def prefill_tokens(self, num_tokens: int) -> int:
        """How many of a chunk's `num_tokens` prompt tokens fit this step (a single token,
        a decode step, is not capped)."""
        num_tokens = min(num_tokens, self.token_budget)
        if num_tokens <= 1 or self.prefill_room is None:
            return num_tokens
        return max(0, min(num_tokens, self.prefill_room))

    def unschedule(self, request: Request) -> None:
        """Drop a running request scheduled earlier in this step (it was just preempted)."""
        num_tokens = self.num_scheduled_tokens.pop(request.req_id, None)
        if num_tokens is None:
            return
        assert request in self.running_reqs, "only running requests are preempted"
        self.running_reqs.remove(request)
        del self.new_block_ids[request.req_id]
        self.token_budget += num_tokens
        prompt_tokens = self._prompt_tokens(request, num_tokens)
        if prompt_tokens > 1 and self.prefill_room is not None:
            self.prefill_room += prompt_tokens
        self.spec_token_ids.pop(request.req_id, None)

    def _take(self, request: Request, num_tokens: int) -> None:
        assert 0 < num_tokens <= self.token_budget
        assert request.req_id not in self.num_scheduled_tokens
        self.num_scheduled_tokens[request.req_id] = num_tokens
        self.token_budget -= num_tokens
        prompt_tokens = self._prompt_tokens(request, num_tokens)
        if prompt_tokens > 1 and self.prefill_room is not None:
            self.prefill_room -= prompt_tokens

    def _prompt_tokens(self, request: Request, num_tokens: int) -> int:
        """Of a request's `num_tokens` this step, those that are not its drafts."""
        return num_tokens - len(self.spec_token_ids.get(request.req_id, ()))

    def build(self, kv: KVCacheManager, finished_ids: set[str], preempted_ids: set[str]) -> SchedulerOutput:
        """The step's output; request.num_computed_tokens must not have advanced yet."""
        new = [
            NewRequestData(
                req_id=r.req_id,
                token_ids=list(r.all_token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                sampling_params=r.sampling_params,
                block_ids=kv.get_block_ids(r.req_id),
                num_computed_tokens=r.num_computed_tokens,
                forced_token_id=r.pending_forced_token_id,
            )
            for r in self.new_reqs
        ]
        cached = CachedRequestData()
        for r in self.running_reqs:
            ids = self.new_block_ids[r.req_id]
            cached.req_ids.append(r.req_id)
            cached.new_block_ids.append(ids if any(ids) else None)
            cached.num_computed_tokens.append(r.num_computed_tokens)
        return SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(self.num_scheduled_tokens),
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            finished_req_ids=finished_ids,
            preempted_req_ids=preempted_ids,
            scheduled_spec_token_ids=dict(self.spec_token_ids),
        )
