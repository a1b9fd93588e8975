"""The scheduler: which requests run each step, with how many tokens, in which blocks.

There are no prefill or decode phases. Each step has a token budget; every scheduled
request advances its num_computed_tokens toward its token count (prompt chunks, prefix
hits and decodes all fall out of that). Running requests go first, then waiting ones in
arrival order. When a running request cannot get a block, the latest-arrived running
request is preempted: its blocks are freed and it recomputes later.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from kvferry.config import CacheConfig, LoadFailurePolicy, SchedulerConfig
from kvferry.errors import InvalidRequestError
from kvferry.kv.spec import KVCacheConfig
from kvferry.messages.engine_core import EngineCoreOutput, EngineCoreRequest
from kvferry.messages.kv_connector import KVConnectorOutput, KVTransferParams, checked_output
from kvferry.messages.model_runner import (
    ModelRunnerOutput,
    PromptLogprob,
    PromptLogprobs,
    RequestFailure,
    SampleLogprobs,
)
from kvferry.messages.scheduler_output import SchedulerOutput
from kvferry.scheduler.drafts import DraftProposer, forced_draft
from kvferry.scheduler.hashing import BlockHasher
from kvferry.scheduler.interfaces import SchedulerConnector
from kvferry.scheduler.kv_cache_manager import KVCacheManager
from kvferry.scheduler.kv_events import KVEventsList
from kvferry.scheduler.request import Request, RequestStatus
from kvferry.scheduler.step_plan import StepPlan
from kvferry.scheduler.stop import append_sampled
from kvferry.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)


def _load_failure_policy(
    policy: LoadFailurePolicy | str | None, connector: SchedulerConnector | None
) -> LoadFailurePolicy:
    """The given policy, else the connector's (its --kv-transfer-config), else FAIL."""
    if policy is not None:
        return LoadFailurePolicy(policy)
    return connector.load_failure_policy if connector is not None else LoadFailurePolicy.FAIL


def _check_config(config: SchedulerConfig, cache: CacheConfig, block_size: int, max_model_len: int) -> None:
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        logger.warning(
            "chunked prefill is off and max_num_batched_tokens (%d) < max_model_len (%d): "
            "longer prompts will be rejected",
            config.max_num_batched_tokens,
            max_model_len,
        )
    if cache.block_size != block_size:
        logger.warning("cache block size %d differs from the KV config's %d", cache.block_size, block_size)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        connector: SchedulerConnector | None = None,
        kv_load_failure_policy: LoadFailurePolicy | str | None = None,
        kv_events_medium: str | None = None,
        speculative: SpeculativeConfig | None = None,
    ):
        """`kv_events_medium`: record the prefix cache's changes (take_kv_events);
        `speculative`: draft tokens for decoding requests (kvferry.scheduler.drafts)."""
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.connector = connector
        self.kv_load_failure_policy = _load_failure_policy(kv_load_failure_policy, connector)
        block_size = kv_cache_config.block_size
        _check_config(scheduler_config, cache_config, block_size, max_model_len)
        # Connectors (offload, P/D) may key blocks by hash even without local prefix caching.
        hashing = cache_config.enable_prefix_caching or connector is not None
        self.block_hasher = BlockHasher(block_size) if hashing else None
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config, cache_config.enable_prefix_caching, self.block_hasher, kv_events_medium
        )
        self.requests: dict[str, Request] = {}  # unfinished ones, and finished ones holding blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # to tell the workers in the next output
        self._preempted_ids: set[str] = set()  # reset outside schedule() (KV load failures)
        self._pending_outputs: list[EngineCoreOutput] = []  # requests failed outside update
        self._delayed_free: set[str] = set()  # finished, blocks held until finished_sending
        self._sent_early: set[str] = set()  # finished_sending came before the request finished
        # Metrics, in tokens: looked up in the prefix cache at admission, and found there.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.connector_hit_tokens = 0  # tokens a connector loaded (external hits)
        self.num_preemptions = 0
        self.drafts = (
            DraftProposer(speculative, max_model_len)
            if speculative is not None and speculative.enabled
            else None
        )

    # ---- requests in and out ----------------------------------------------------------

    def add_request(self, request: EngineCoreRequest | Request, eos_token_ids: Iterable[int] = ()) -> None:
        """Queue a request. Raises InvalidRequestError for an empty or too-long prompt."""
        if isinstance(request, EngineCoreRequest):
            request = Request.from_engine_core_request(
                request, eos_token_ids, self.max_model_len, self.block_hasher, self.config.default_max_tokens
            )
        elif self.block_hasher is not None:
            request.attach_block_hasher(self.block_hasher)
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        self.requests[request.req_id] = request
        self.waiting.append(request)
        if self.connector is not None:
            self.connector.request_added(request)

    def abort_requests(self, req_ids: str | Iterable[str]) -> None:
        """Finish requests now and free their blocks; unknown or finished ids are ignored."""
        for req_id in [req_ids] if isinstance(req_ids, str) else req_ids:
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED, emit=False)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_finished_requests(self) -> bool:
        """Whether the next step has news for workers or clients even if nothing runs."""
        news = self._finished_ids or self._preempted_ids or self._pending_outputs
        return bool(news) or self.kv_cache_manager.has_page_changes()

    def has_pending_kv_transfers(self) -> bool:
        """Finished requests whose blocks wait for a connector's finished_sending."""
        return bool(self._delayed_free)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def take_kv_events(self) -> KVEventsList:
        """KV events since the last call: blocks stored in / removed from the prefix cache."""
        return self.kv_cache_manager.take_events()

    # ---- schedule ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(token_budget=self.config.max_num_batched_tokens, prefill_room=self._prefill_room())
        self._schedule_running(plan)
        if plan.num_preempted == 0:
            self._schedule_waiting(plan)
        output = plan.build(self.kv_cache_manager, self._finished_ids, self._preempted_ids)
        self._finished_ids, self._preempted_ids = set(), set()
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        output.kv_pages = self.kv_cache_manager.take_page_changes()  # after every alloc and free
        return output

    def _prefill_room(self) -> int | None:
        """The step's cap on prompt tokens: the configured budget while a request decodes."""
        if not self.config.caps_prefill_with_decodes:
            return None
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        return self.config.prefill_budget_with_decodes if decoding else None

    def _schedule_running(self, plan: StepPlan) -> None:
        kv = self.kv_cache_manager
        drafting = self.drafts is not None and self.drafts.active(len(self.running))
        i = 0
        while i < len(self.running) and plan.token_budget > 0:
            request = self.running[i]
            num_new = plan.prefill_tokens(request.num_tokens - request.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            if not kv.can_fit(request.num_computed_tokens + num_new):
                logger.warning(
                    "request %s outgrew the whole KV cache after %d tokens",
                    request.req_id,
                    request.num_tokens,
                )
                self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
                continue
            drafts = self._drafts(request, request.num_computed_tokens, num_new, plan.token_budget, drafting)
            if drafts and self._schedule_drafts(request, num_new, drafts, plan):
                i += 1
                continue
            while (new_ids := kv.allocate_slots(request, num_new)) is None:
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim, plan)
                if victim is request:
                    break
            if new_ids is not None:
                plan.add_running(request, num_new, new_ids)
                i += 1

    def _drafts(
        self, request: Request, num_computed: int, num_new: int, token_budget: int, drafting: bool
    ) -> list[int]:
        """Draft tokens for a request whose `num_new` tokens after `num_computed` this step
        end what it knows: its forced first token after its prompt
        (kvferry.scheduler.drafts.forced_draft), else, while drafting, proposed ones after its
        last token."""
        if num_computed + num_new != request.num_tokens or num_new >= token_budget:
            return []
        forced = forced_draft(request)
        if forced or not drafting or num_new != 1:
            return forced
        assert self.drafts is not None
        return self.drafts.propose(request, token_budget)

    def _schedule_drafts(self, request: Request, num_new: int, drafts: list[int], plan: StepPlan) -> bool:
        """Schedule a running request with its drafts when their blocks are free (never
        preempting for a draft); False: schedule it plainly."""
        num_tokens = num_new + len(drafts)
        if not self.kv_cache_manager.can_fit(request.num_computed_tokens + num_tokens):
            return False
        new_ids = self.kv_cache_manager.allocate_slots(request, num_tokens)
        if new_ids is None:
            return False
        plan.add_running(request, num_tokens, new_ids, drafts)
        return True

    def _pick_victim(self) -> Request:
        """The lowest-priority running request: latest arrival (later position on ties)."""
        return max(reversed(self.running), key=lambda r: r.arrival_time)

    def _preempt(self, request: Request, plan: StepPlan | None = None) -> None:
        self.running.remove(request)
        if plan is not None:
            plan.unschedule(request)
            plan.num_preempted += 1
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_ids.add(request.req_id)
        self.waiting.appendleft(request)
        logger.debug("preempted %s (%d tokens)", request.req_id, request.num_tokens)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        skipped: list[Request] = []  # loading remote KV, or deferred: keep their place in the queue
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(self.waiting.popleft())
                continue
            admitted = self._admit(request, plan)
            if admitted is None:  # the connector cannot tell its hits yet: ask again next step
                skipped.append(self.waiting.popleft())
                continue
            if not admitted:
                break
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, request: Request, plan: StepPlan) -> bool | None:
        """Try to start the head of the waiting queue. False: stop admitting this step;
        None: the connector deferred the request (it stays waiting, untouched)."""
        kv = self.kv_cache_manager
        if request.num_computed_tokens == 0:
            hits, num_local = kv.get_computed_blocks(request)
            try:
                external = self._external_hits(request, num_local)
            except InvalidRequestError as exc:  # e.g. kv_transfer_params that do not check out
                self._finish(
                    request, RequestStatus.FINISHED_ERROR, exc.message, invalid_param=exc.param or ""
                )
                return True
            if external is None:
                return None
            num_external, load_async = external
        else:  # its remote KV has arrived
            hits, num_local, num_external, load_async = None, 0, 0, False
        num_computed = request.num_computed_tokens + num_local + num_external
        num_new = 0 if load_async else request.num_tokens - num_computed
        # Without chunked prefill a prompt runs whole; a resumed request may still be chunked.
        chunkable = self.config.enable_chunked_prefill or request.num_output_tokens > 0
        if not chunkable and num_new > plan.token_budget:
            if num_new <= self.config.max_num_batched_tokens:
                return False
            message = self._too_long_message(request, num_new)
            self._finish(request, RequestStatus.FINISHED_ERROR, message, invalid_param="prompt")
            return True
        num_new = plan.prefill_tokens(num_new) if chunkable else min(num_new, plan.token_budget)
        if num_new == 0 and not load_async:  # the step's prompt tokens are spent
            return False
        if not kv.can_fit(request.num_tokens):
            message = f"the request needs more KV cache than the engine has ({kv.num_blocks} blocks)"
            self._finish(request, RequestStatus.FINISHED_ERROR, message, invalid_param="prompt")
            return True
        drafts = [] if load_async else self._drafts(request, num_computed, num_new, plan.token_budget, False)
        if drafts and kv.allocate_slots(request, num_new + num_external + len(drafts), hits) is None:
            drafts = []  # no room for the draft's slot: the request starts without it
        if not drafts and kv.allocate_slots(request, num_new + num_external, hits) is None:
            return False
        self._count_hits(request, num_local, num_external)
        if self.connector is not None:
            self.connector.update_state_after_alloc(request, kv.get_block_ids(request.req_id), num_external)
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        if load_async:  # stays queued; skipped until its KV arrives
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return True
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.add_new(request, num_new + len(drafts), drafts)
        return True

    def _external_hits(self, request: Request, num_local: int) -> tuple[int, bool] | None:
        if self.connector is None:
            return 0, False
        num, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        if num is None:
            return None
        num = max(0, min(num, request.num_tokens - 1 - num_local))  # the last token is computed
        return num, load_async and num > 0

    def _count_hits(self, request: Request, num_local: int, num_external: int) -> None:
        if request.num_computed_tokens == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_local
            self.connector_hit_tokens += num_external

    def _too_long_message(self, request: Request, num_new: int) -> str:
        return (
            f"the request needs {num_new} tokens in one step but max_num_batched_tokens is "
            f"{self.config.max_num_batched_tokens} and chunked prefill is disabled"
        )

    # ---- results ----------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply a step's results; one output per request that got tokens or finished.

        Connector results come first (update_connector_output, failed loads, finished
        transfers), then each scheduled request's sampled tokens and stop checks.
        """
        outputs: list[EngineCoreOutput] = []
        reset = self._update_kv_transfers(model_runner_output.kv_connector_output)
        self._fail_requests(model_runner_output.failed)
        index = {req_id: i for i, req_id in enumerate(model_runner_output.req_ids)}
        any_finished = False
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING or req_id in reset:
                continue  # aborted, preempted or reset since it was scheduled
            i = index.get(req_id)
            sampled = model_runner_output.sampled_token_ids[i] if i is not None else []
            logprobs = (  # one per sampled token
                model_runner_output.logprobs[i]
                if i is not None and i < len(model_runner_output.logprobs)
                else None
            )
            record_prompt_logprobs(request, model_runner_output.prompt_logprobs.get(req_id))
            drafts = scheduler_output.scheduled_spec_token_ids.get(req_id, ())
            output = self._apply_sampled(request, sampled, logprobs, len(drafts))
            if output is not None and request.num_output_tokens == len(output.new_token_ids):
                output.prompt_logprobs = prompt_logprobs_of(request)  # with the first tokens
            if output is not None:
                outputs.append(output)
                any_finished = any_finished or output.finished
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        # Requests failed outside the stop checks (in schedule() or just now) report too.
        outputs, self._pending_outputs = self._pending_outputs + outputs, []
        return outputs

    def _fail_requests(self, failed: dict[str, RequestFailure]) -> None:
        """Finish the requests the worker failed (their tokens this step are void)."""
        for req_id, failure in failed.items():
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished:
                self._finish(
                    request, RequestStatus.FINISHED_ERROR, failure.message, invalid_param=failure.param
                )

    def _apply_sampled(
        self, request: Request, sampled: list[int], logprobs: list[SampleLogprobs] | None, num_drafts: int
    ) -> EngineCoreOutput | None:
        """`sampled`: the step's tokens, its kept drafts and one sampled token. The KV
        computed for the drafts it did not keep is void: the request's computed tokens
        step back past them (their slots are written again by the next steps)."""
        if not sampled:
            request.num_computed_tokens -= num_drafts
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            return None
        num_kept = len(sampled) - 1
        if num_drafts:
            assert num_kept <= num_drafts, f"{request}: {sampled} for {num_drafts} drafts"
            request.num_computed_tokens -= num_drafts - num_kept
            if request.num_output_tokens > 0:  # proposed; a first token's draft was forced
                assert self.drafts is not None, f"{request}: drafts without a proposer"
                self.drafts.record(request, num_drafts, num_kept)
        assert request.num_computed_tokens == request.num_tokens + num_kept, (
            f"{request} sampled before its last token"
        )
        new_tokens = append_sampled(request, sampled, self.max_model_len)
        self.kv_cache_manager.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        output = self._output(request, new_tokens)
        if logprobs is not None:
            output.new_logprobs = logprobs[: len(new_tokens)]
        if request.is_finished:
            output.kv_transfer_params = self._release(request, receiving=False)
        return output

    def _output(self, request: Request, new_tokens: list[int]) -> EngineCoreOutput:
        return EngineCoreOutput(
            req_id=request.req_id,
            new_token_ids=new_tokens,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(0, request.num_cached_tokens),
            error=request.error,
            invalid_param=request.invalid_param,
        )

    # ---- finishing --------------------------------------------------------------------

    def _finish(
        self,
        request: Request,
        status: RequestStatus,
        error: str | None = None,
        emit: bool = True,
        invalid_param: str | None = None,
    ) -> None:
        """Finish a request outside the normal stop checks (abort, failure).

        With invalid_param the error is the client's (HTTP 400), naming that parameter.
        """
        receiving = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.error = error
        request.invalid_param = invalid_param
        if error is not None:
            logger.warning("request %s failed: %s", request.req_id, error)
        params = self._release(request, receiving)
        if emit:
            output = self._output(request, [])
            output.kv_transfer_params = params
            self._pending_outputs.append(output)

    def _release(self, request: Request, receiving: bool) -> KVTransferParams | None:
        """Free a finished request's blocks, unless a connector still needs them."""
        req_id = request.req_id
        self._finished_ids.add(req_id)
        delay, params = False, None
        if self.connector is not None:
            delay, params = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(req_id)
            )
        if delay and req_id in self._sent_early:
            delay = False  # the connector already reported the blocks done
        if delay or receiving:  # a transfer may still read or write these blocks
            self._delayed_free.add(req_id)
        else:
            self._sent_early.discard(req_id)
            self.kv_cache_manager.free(request)
            del self.requests[req_id]
        return params

    def _free_delayed(self, req_id: str) -> None:
        if req_id in self._delayed_free:
            self._delayed_free.discard(req_id)
            self._sent_early.discard(req_id)
            self.kv_cache_manager.free(self.requests.pop(req_id))
        elif req_id in self.requests:  # sending done before the request finished
            self._sent_early.add(req_id)

    # ---- KV connector results -----------------------------------------------------------

    def _update_kv_transfers(self, raw_output: object | None) -> set[str]:
        """Act on the step's KVConnectorOutput; returns running requests reset by failed loads."""
        kv_output = checked_output(raw_output)
        if kv_output is None:
            return set()
        if self.connector is not None:
            self.connector.update_connector_output(kv_output)
        reset = self._handle_invalid_blocks(kv_output)
        failed = kv_output.failed_recving
        done = kv_output.finished_recving | failed
        for req_id in done:
            self._on_recv_done(req_id, failed=req_id in failed)
        for req_id in kv_output.finished_sending:
            self._free_delayed(req_id)
        return reset

    def _on_recv_done(self, req_id: str, failed: bool) -> None:
        request = self.requests.get(req_id)
        if request is None:
            return
        if request.is_finished:  # aborted while its KV was arriving
            self._free_delayed(req_id)
            return
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            logger.warning("KV receive reported for %s, which is not waiting for it", req_id)
            return
        request.status = RequestStatus.WAITING  # the transfer is over: blocks are ours again
        if not failed:
            self.kv_cache_manager.cache_loaded_blocks(request)
        elif self.kv_load_failure_policy is LoadFailurePolicy.FAIL:
            self._finish(request, RequestStatus.FINISHED_ERROR, "loading the request's KV cache failed")
        else:
            logger.warning("loading KV for %s failed; recomputing it", req_id)
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.num_cached_tokens = -1  # measured again when it is admitted

    def _handle_invalid_blocks(self, kv_output: KVConnectorOutput) -> set[str]:
        """Running requests whose KV load inside the step failed: failed or reset, per policy."""
        invalid = kv_output.invalid_block_ids
        if not invalid:
            return set()
        kv = self.kv_cache_manager
        hit = [
            r for r in self.running if any(b in invalid for ids in kv.get_block_ids(r.req_id) for b in ids)
        ]
        for request in hit:
            if self.kv_load_failure_policy is LoadFailurePolicy.FAIL:
                self._finish(request, RequestStatus.FINISHED_ERROR, "loading the request's KV cache failed")
            else:
                logger.warning("KV blocks of %s failed to load; recomputing it", request.req_id)
                self._preempt(request)
                if request.num_output_tokens == 0:
                    request.num_cached_tokens = -1  # measured again when it is admitted
        return {r.req_id for r in hit}


def record_prompt_logprobs(request: Request, chunk: PromptLogprobs | None) -> None:
    """Keep a step's prompt logprobs (a recomputed prompt, after preemption, replaces them)."""
    if chunk is not None:
        del request.prompt_logprobs[chunk.first :]
        request.prompt_logprobs.extend(chunk.entries)


def prompt_logprobs_of(request: Request) -> list[PromptLogprob] | None:
    return None if request.sampling_params.prompt_logprobs is None else list(request.prompt_logprobs)
