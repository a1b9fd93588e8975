"""EngineCore: the loop schedule -> execute -> update."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from kvferry.config import EngineConfig, ExecutorKind, SchedulerConfig
from kvferry.connector.base import KVConnectorRole
from kvferry.connector.factory import create_connector, resolve_connector
from kvferry.engine.capture_choice import decide_capture, follow_stored_choice
from kvferry.engine.kv_event_publisher import KVEventPublisher
from kvferry.engine.profile_run import size_kv_cache
from kvferry.engine.startup_report import StartupClock, StartupPhase
from kvferry.engine.warmup import warmup_steps
from kvferry.executor.base import Executor
from kvferry.executor.rank_start import RankStart
from kvferry.kv.spec import KVCacheConfig
from kvferry.kv.usage import KVGroupStats, KVMemoryStats
from kvferry.messages.engine_core import EngineCoreOutput, EngineCoreRequest
from kvferry.messages.kv_connector import KVConnectorOutput
from kvferry.messages.scheduler_output import SchedulerOutput
from kvferry.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    kv_connector: dict[str, float] = field(default_factory=dict)  # running totals of connector stats
    kv_memory: KVMemoryStats = field(default_factory=KVMemoryStats)
    kv_groups: list[KVGroupStats] = field(default_factory=list)  # one per KV cache group
    kv_event_batches_published: int = 0  # KV event batches queued for the publisher's socket
    kv_event_batches_dropped: int = 0  # batches dropped because the publisher's queue was full
    spec_decode_num_draft_tokens: int = 0  # draft tokens verified (--speculative-config)
    spec_decode_num_accepted_tokens: int = 0  # of those, kept


def make_executor(config: EngineConfig, rank_start: RankStart = RankStart.SUBPROCESS) -> Executor:
    kind = config.parallel.executor
    if kind is ExecutorKind.UNIPROC and config.parallel.tensor_parallel_size > 1:
        kind = ExecutorKind.MULTIPROC  # one process per rank
    if kind is ExecutorKind.UNIPROC:
        from kvferry.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config)
    if kind is ExecutorKind.MULTIPROC:
        from kvferry.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, rank_start)
    from kvferry.executor.ray_executor import RayExecutor

    return RayExecutor(config)


class EngineCore:
    def __init__(self, config: EngineConfig, rank_start: RankStart = RankStart.SUBPROCESS):
        """rank_start: how TP ranks start (FORK only from the engine core's own process)."""
        config = resolve_connector(config)  # once: its class and the settings every half and rank shares
        self.config = config
        self._connector_totals: dict[str, float] = {}
        clock = StartupClock()
        self.executor = make_executor(config, rank_start)
        clock.lap(StartupPhase.EXECUTOR)
        self.kv_budget, kv_config = size_kv_cache(self.executor, config)
        clock.lap(StartupPhase.MEMORY_PROFILE)
        self.executor.initialize_kv_cache(kv_config)
        self.connector = create_connector(config, KVConnectorRole.SCHEDULER, kv_config)
        events = config.kv_events
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            kv_config,
            config.model.max_model_len,
            connector=self.connector,
            kv_events_medium=kv_events_medium(config.device) if events.enabled else None,
            speculative=config.speculative,
        )
        self.kv_events = KVEventPublisher(events) if events.enabled else None
        clock.lap(StartupPhase.KV_CACHE)
        stored = follow_stored_choice(self.executor, config)
        self._warm_up(kv_config)
        clock.lap(StartupPhase.WARM_UP)
        self.capture_decision = decide_capture(self.executor, config, kv_config, self._run_dummy, stored)
        clock.lap(StartupPhase.CAPTURE_DECISION)
        compile_s = max(s.compile_seconds for s in self.executor.capture_stats())
        self.startup = clock.report(compile_s, self.capture_decision.describe())
        self._last_log = time.monotonic()
        logger.info("%s", self.startup.describe())
        logger.info(
            "engine ready in %.1fs: %s, %d KV blocks of %d tokens, %s",
            self.startup.engine_s,
            config.model.served_model_name,
            kv_config.num_blocks,
            kv_config.block_size,
            describe_step_budget(config.scheduler),
        )

    def _warm_up(self, kv_config: KVCacheConfig) -> None:
        """Dummy steps through the real path (the decode one compiles the captured forward)."""
        for step in warmup_steps(self.config, kv_config):
            self._run_dummy(step)

    def _run_dummy(self, step: SchedulerOutput) -> None:
        """A dummy step through the real path; connector metadata comes from the scheduler half."""
        if self.connector is not None:
            step.kv_connector_metadata = self.connector.build_connector_meta(SchedulerOutput.empty())
        self.executor.execute_model(step)

    def add_request(self, req: EngineCoreRequest) -> None:
        self.scheduler.add_request(req, self.config.model.eos_token_ids)

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.abort_requests(req_ids)

    def release_kv(self, req_ids: list[str]) -> None:
        """Finished requests whose KV the connector keeps for a remote consumer that will not
        come (the client left): the connector frees it (unknown ids are ignored)."""
        if self.connector is not None:
            self.connector.release_kept(list(req_ids))

    def has_unfinished_requests(self) -> bool:
        """Work left for step(): requests to run, finished ids the workers must still drop,
        or KV transfers whose completion frees blocks."""
        s = self.scheduler
        return s.has_unfinished_requests() or s.has_finished_requests() or s.has_pending_kv_transfers()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        self._accumulate_connector_stats(runner_output.kv_connector_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._publish_kv_events()
        self._maybe_log()
        return outputs

    def _publish_kv_events(self) -> None:
        if self.kv_events is None:
            return
        events = self.scheduler.take_kv_events()
        if events:
            self.kv_events.publish(events)

    def _accumulate_connector_stats(self, kv_output: KVConnectorOutput | None) -> None:
        if kv_output is None or kv_output.stats is None:
            return
        for key, value in kv_output.stats.data.items():
            self._connector_totals[key] = self._connector_totals.get(key, 0.0) + value

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            num_free_blocks=s.kv_cache_manager.num_free_blocks,
            num_blocks=s.kv_cache_manager.num_blocks,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            kv_connector=dict(self._connector_totals),
            kv_memory=s.kv_cache_manager.memory_stats(),
            kv_groups=list(s.kv_cache_manager.group_stats()),
            kv_event_batches_published=0 if self.kv_events is None else self.kv_events.num_queued,
            kv_event_batches_dropped=0 if self.kv_events is None else self.kv_events.num_dropped,
            spec_decode_num_draft_tokens=0 if s.drafts is None else s.drafts.num_draft_tokens,
            spec_decode_num_accepted_tokens=0 if s.drafts is None else s.drafts.num_accepted_tokens,
        )

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL_S:
            return
        self._last_log = now
        st = self.stats()
        logger.info(
            "running %d, waiting %d, KV usage %.1f%%, prefix hits %d/%d tokens, preemptions %d",
            st.num_running,
            st.num_waiting,
            100 * st.kv_cache_usage,
            st.prefix_cache_hits,
            st.prefix_cache_queries,
            st.num_preemptions,
        )
        if st.spec_decode_num_draft_tokens:
            logger.info(
                "speculative decoding: %d of %d draft tokens kept (%.1f%%)",
                st.spec_decode_num_accepted_tokens,
                st.spec_decode_num_draft_tokens,
                100 * st.spec_decode_num_accepted_tokens / st.spec_decode_num_draft_tokens,
            )
        if st.kv_connector:
            logger.info(
                "KV connector: %s", ", ".join(f"{k} {v:g}" for k, v in sorted(st.kv_connector.items()))
            )

    def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
        self.executor.shutdown()
        self.scheduler.kv_cache_manager.close()  # leave the shared KV memory pool, if any


def kv_events_medium(device: str) -> str:
    """Where the KV the events describe lives, in vLLM's words."""
    return "CPU" if device == "cpu" else "GPU"


def describe_step_budget(config: SchedulerConfig) -> str:
    """The step's token budgets, as the start-up log states them."""
    tokens = f"{config.max_num_batched_tokens} tokens per step"
    if not config.caps_prefill_with_decodes:
        return f"{tokens}, prompt tokens not capped while requests decode"
    return f"{tokens}, at most {config.prefill_budget_with_decodes} prompt tokens while requests decode"
