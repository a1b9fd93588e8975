"""ModelRunner: keeps per-request state, builds inputs, runs the forward, samples."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from kvferry.config import EngineConfig
from kvferry.connector.base import KVConnectorBase, KVConnectorMetadata
from kvferry.kv.spec import KVCacheConfig
from kvferry.messages.kv_connector import KVConnectorOutput, KVConnectorStats
from kvferry.messages.model_runner import ModelRunnerOutput, RequestFailure, SampleLogprobs
from kvferry.messages.scheduler_output import SchedulerOutput
from kvferry.model.forward_context import ForwardContext, Workspace
from kvferry.spec_decode.verify import accepted_tokens
from kvferry.structured.backend import GrammarBackend, GrammarCompileError
from kvferry.worker.capture import CapturedForward, hook_placement
from kvferry.worker.connector_guard import ConnectorGuard
from kvferry.worker.inputs import StepInputs, build_step_inputs
from kvferry.worker.prompt_logprobs import compute_prompt_logprobs
from kvferry.worker.request_state import RequestState, build_sampling_batch
from kvferry.worker.sampler import Sampler

if TYPE_CHECKING:
    from kvferry.model.causal_lm import CausalLM

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM, device: torch.device):
        self.config = config
        self.model = model
        self.device = device
        self.sampler = Sampler(torch.Generator(device="cpu").manual_seed(config.seed))
        self.states: dict[str, RequestState] = {}
        self.kv_config: KVCacheConfig | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layer_group: dict[str, int] = {}
        self.connector: KVConnectorBase | None = None
        self.workspace = Workspace()  # scratch for gathered KV, shared by every layer
        self.forward: CapturedForward | None = None  # set with the KV caches
        self.grammars: GrammarBackend | None = None  # built with the first structured request
        self._failed: dict[str, RequestFailure] = {}  # this step's failed requests

    def bind_kv_caches(
        self,
        kv_config: KVCacheConfig,
        kv_caches: dict[str, torch.Tensor],
        connector: KVConnectorBase | None = None,
    ) -> None:
        self.kv_config = kv_config
        self.kv_caches = kv_caches
        self.layer_group = {name: kv_config.group_of(name) for name in kv_caches}
        self.connector = connector
        placement = hook_placement(connector)
        self.model.set_hook_placement(placement)
        self.forward = CapturedForward(self.model, placement, self.config.compilation, self.device)

    def bound_forward(self) -> CapturedForward:
        """The forward over the bound KV caches; RuntimeError before bind_kv_caches."""
        if self.forward is None:
            raise RuntimeError("no KV caches are bound to the model runner")
        return self.forward

    def _bound_kv_config(self) -> KVCacheConfig:
        if self.kv_config is None:
            raise RuntimeError("no KV caches are bound to the model runner")
        return self.kv_config

    def unbind_kv_caches(self) -> None:
        """Drop the KV tensors (the profiling step's provisional cache) and every request."""
        self.kv_config, self.kv_caches, self.layer_group = None, {}, {}
        self.connector, self.forward = None, None
        self.states.clear()

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._failed = {}
        self._update_states(scheduler_output)
        output = self._run_step_with_connector(scheduler_output)
        if self._failed:
            output.failed = self._failed
        return output

    def _run_step_with_connector(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.connector is None:
            return self._run_step(scheduler_output)
        # Invariant 1: the metadata is bound for the whole step, empty steps included.
        metadata = scheduler_output.kv_connector_metadata
        assert isinstance(metadata, KVConnectorMetadata), f"bad connector metadata {metadata!r}"
        guard = ConnectorGuard(self.connector)
        with self.connector.bound(metadata):
            guard.start_load_kv()
            output = self._run_step(scheduler_output, guard)
            guard.wait_for_save()
            kv_output = self._collect_connector_output(self.connector, scheduler_output)
        if guard.load_failed:
            kv_output.invalid_block_ids |= self._step_block_ids(scheduler_output)
        if guard.save_failed:
            kv_output.stats = (kv_output.stats or KVConnectorStats()).aggregate(
                KVConnectorStats({"save_errors": 1})
            )
        output.kv_connector_output = kv_output
        return output

    def _collect_connector_output(
        self, connector: KVConnectorBase, scheduler_output: SchedulerOutput
    ) -> KVConnectorOutput:
        try:
            return connector.collect_output(scheduler_output.finished_req_ids)
        except Exception:
            logger.exception("KV connector %s failed to report results", type(connector).__name__)
            return KVConnectorOutput(invalid_block_ids=self._step_block_ids(scheduler_output))

    def _step_block_ids(self, scheduler_output: SchedulerOutput) -> set[int]:
        """Every block of the requests in this step: what a failed load may have left invalid."""
        ids: set[int] = set()
        for req_id in scheduler_output.num_scheduled_tokens:
            for group in self.states[req_id].block_ids:
                ids.update(group)
        return ids

    def _run_step(
        self, scheduler_output: SchedulerOutput, hooks: ConnectorGuard | None = None
    ) -> ModelRunnerOutput:
        if scheduler_output.is_empty:
            return ModelRunnerOutput.empty()
        states = [self.states[req_id] for req_id in scheduler_output.num_scheduled_tokens]
        kv_config = self._bound_kv_config()
        drafts = scheduler_output.scheduled_spec_token_ids
        inputs = build_step_inputs(
            states, scheduler_output.num_scheduled_tokens, kv_config, self.device, drafts
        )
        # structured outputs: the grammars' masks are filled while the forward runs
        masks = self.grammars.start_fill([s.grammar for s in inputs.sample_states]) if self.grammars else None
        every_row = any(s.params.prompt_logprobs is not None for s in inputs.ordered)
        hidden = self._forward(inputs, hooks, every_row)
        output = ModelRunnerOutput(req_ids=[s.req_id for s in inputs.ordered])
        if every_row:
            output.prompt_logprobs = compute_prompt_logprobs(hidden, inputs.spans, self.model.compute_logits)
            hidden = hidden.index_select(0, self._sample_rows(inputs))
        sampled = self._sample(hidden, inputs, masks, drafts)
        for state in inputs.ordered:
            tokens, logprobs = sampled.get(state.req_id, ([], None))
            num_void = len(drafts.get(state.req_id, ())) - max(0, len(tokens) - 1)  # drafts not kept
            state.num_computed_tokens += scheduler_output.num_scheduled_tokens[state.req_id] - num_void
            state.token_ids.extend(tokens)
            output.sampled_token_ids.append(tokens)
            output.logprobs.append(logprobs)
        return output

    def _sample_rows(self, inputs: StepInputs) -> torch.Tensor:
        return torch.tensor(inputs.sample_rows, dtype=torch.int64, device=self.device)

    def _forward(self, inputs: StepInputs, hooks: ConnectorGuard | None, every_row: bool) -> torch.Tensor:
        """The final hidden states of the sampled rows (`inputs.sample_rows`, in order), or
        of every row (`every_row`: prompt logprobs read them all)."""
        ctx = ForwardContext(
            attn=inputs.attn,
            layer_group=self.layer_group,
            kv_caches=self.kv_caches,
            layout=self._bound_kv_config().layout,
            kv_hooks=hooks,
            workspace=self.workspace,
        )
        num_tokens = inputs.input_ids.numel()
        ascending = sorted(inputs.sample_rows)  # the forward keeps rows in ascending order
        keep_rows = None
        if not every_row and len(ascending) < num_tokens:
            keep_rows = torch.tensor(ascending, dtype=torch.int64, device=self.device)
        hidden = self.bound_forward()(inputs.input_ids, inputs.positions, ctx, keep_rows)
        if every_row or ascending == inputs.sample_rows:
            return hidden
        place = {row: i for i, row in enumerate(ascending)}  # a request's rows, split around its prompt's end
        order = [place[row] for row in inputs.sample_rows]
        return hidden.index_select(0, torch.tensor(order, dtype=torch.int64, device=self.device))

    def _sample(
        self,
        hidden: torch.Tensor,
        inputs: StepInputs,
        masks: Future[torch.Tensor] | None,
        drafts: dict[str, list[int]],
    ) -> dict[str, tuple[list[int], list[SampleLogprobs] | None]]:
        """Per sampling request, its tokens (with drafts: the kept ones and one more) and
        their logprobs; `hidden`: the sampled rows' final hidden states."""
        if not inputs.sample_rows:
            return {}
        logits = self.model.compute_logits(hidden)
        batch = build_sampling_batch(
            inputs.sample_states, self.config.model.eos_token_ids, inputs.sample_offsets
        )
        batch.token_bitmask = masks.result() if masks is not None else None
        sampled = self.sampler(logits, batch)
        for row in sampled.refused_rows:
            state = inputs.sample_states[row]
            state.grammar = None  # its token is void: the scheduler fails the request
            self._failed[state.req_id] = RequestFailure(
                "the request's constraints refuse every token (allowed_token_ids, bad_words, "
                "min_tokens and its structured output contradict each other)",
                param="allowed_token_ids" if state.params.allowed_token_ids is not None else "",
            )
        for state, token in zip(inputs.sample_states, sampled.tokens):
            if state.grammar is not None:  # never drafted for (kvferry.scheduler.drafts)
                state.grammar.accept(token)
        return per_request_samples(inputs.sample_states, sampled.tokens, sampled.logprobs, drafts)

    def _grammar_backend(self) -> GrammarBackend:
        if self.grammars is None:
            from kvferry.model.tokenizer import load_tokenizer

            model = self.config.model
            self.grammars = GrammarBackend(load_tokenizer(model), model.vocab_size, model.eos_token_ids)
        return self.grammars

    def _start_grammar(self, state: RequestState, num_prompt_tokens: int) -> None:
        """The request's matcher; a spec that does not compile for this model's tokenizer
        (it passed the front end's check, which has none) fails this request only."""
        spec = state.params.structured_outputs
        assert spec is not None
        try:
            state.grammar = self._grammar_backend().new_request(
                state.req_id, spec, state.token_ids, num_prompt_tokens
            )
        except GrammarCompileError as exc:
            self._failed[state.req_id] = RequestFailure(str(exc), param="structured_outputs")

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(req_id, None)
        for data in so.scheduled_new_reqs:
            self.states[data.req_id] = state = RequestState.from_new(data)
            if data.sampling_params.structured_outputs is not None:
                self._start_grammar(state, data.num_prompt_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.states[req_id]
            state.num_computed_tokens = num_computed
            if new_blocks is not None:
                for group_blocks, added in zip(state.block_ids, new_blocks, strict=True):
                    group_blocks.extend(added)


def per_request_samples(
    states: list[RequestState],
    tokens: list[int],
    logprobs: list[SampleLogprobs | None],
    drafts: dict[str, list[int]],
) -> dict[str, tuple[list[int], list[SampleLogprobs] | None]]:
    """The sampled rows grouped by request (a request with drafts has one row per draft
    and one more, consecutive), its drafts judged by kvferry.spec_decode.verify."""
    result: dict[str, tuple[list[int], list[SampleLogprobs] | None]] = {}
    row = 0
    while row < len(states):
        state = states[row]
        req_drafts = drafts.get(state.req_id, [])
        stop = row + len(req_drafts) + 1
        kept = accepted_tokens(req_drafts, tokens[row:stop]) if req_drafts else [tokens[row]]
        row_logprobs = logprobs[row : row + len(kept)]
        has_logprobs = all(lp is not None for lp in row_logprobs)
        result[state.req_id] = (kept, [lp for lp in row_logprobs if lp is not None] if has_logprobs else None)
        row = stop
    return result
