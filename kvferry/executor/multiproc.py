"""Executor with one worker process per tensor-parallel rank (torch.distributed: gloo/NCCL).

Each rank is its own process (kvferry.executor.rank_start: a program of its own, or a fork
of the engine core process), connected to the executor by a socket pair. The RPC surface is
typed: a WorkerCall carries one of the Worker methods in WORKER_METHODS; each rank answers
with a WorkerReply carrying the result or the error text. Every call goes to every rank;
replies come back in rank order.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvferry.config import EngineConfig
from kvferry.errors import KVFerryError
from kvferry.executor.base import Executor
from kvferry.executor.rank import R, RankSetup, WorkerCall, WorkerReply
from kvferry.executor.rank_start import RankProcess, RankStart, start_rank
from kvferry.kv.allocate import with_num_blocks
from kvferry.kv.spec import KVCacheConfig
from kvferry.kv.usage import KVMemoryUsage
from kvferry.messages.model_runner import ModelRunnerOutput
from kvferry.messages.scheduler_output import SchedulerOutput
from kvferry.ports import free_port
from kvferry.worker.capture import CaptureDecision, CaptureStats
from kvferry.worker.memory_profile import MemoryProfile
from kvferry.worker.worker import Worker

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600
STOP_TIMEOUT_S = 10


class WorkerError(KVFerryError, RuntimeError):
    """A worker process failed or died."""


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, rank_start: RankStart = RankStart.SUBPROCESS):
        super().__init__(config)
        self.world_size = config.parallel.tensor_parallel_size
        self.procs: list[RankProcess] = []
        self.conns: list[Connection] = []
        port = free_port()
        try:
            for rank in range(self.world_size):
                proc, conn = start_rank(rank_start, rank, self.conns)
                self.procs.append(proc)
                self.conns.append(conn)
                conn.send(RankSetup(rank, self.world_size, port, config))
            self._gather(timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            self._kill_ranks()
            raise
        logger.info("started %d worker processes", self.world_size)

    def _gather(self, timeout: float | None = None) -> list[Any]:
        replies: list[WorkerReply] = []
        for rank, conn in enumerate(self.conns):
            if timeout is not None and not conn.poll(timeout):
                raise WorkerError(f"worker rank {rank} did not answer in {timeout}s")
            try:
                replies.append(conn.recv())
            except EOFError as exc:
                raise WorkerError(f"worker rank {rank} died (exit code {self._exit_code(rank)})") from exc
        errors = [r for r in replies if r.error]
        if errors:
            raise WorkerError(f"worker rank {errors[0].rank} failed:\n{errors[0].error}")
        return [r.result for r in replies]

    def _exit_code(self, rank: int) -> int | None:
        try:
            return self.procs[rank].wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None

    def collective_rpc(self, method: Callable[..., R], *args: Any) -> list[R]:
        call = WorkerCall(method, args)
        for conn in self.conns:
            conn.send(call)
        return self._gather()

    def prepare_memory_profile(self, num_blocks: int) -> KVCacheConfig:
        return self.collective_rpc(Worker.prepare_memory_profile, num_blocks)[0]

    def finish_memory_profile(self) -> list[MemoryProfile]:
        return self.collective_rpc(Worker.finish_memory_profile)

    def free_memory(self) -> list[int]:
        return self.collective_rpc(Worker.free_memory)

    def determine_kv_cache_config(self, budget_bytes: int) -> KVCacheConfig:
        """Rank 0's specs (the scheduler's view) with the smallest block count of any rank.

        Ranks may cache different numbers of KV heads (uneven head split), so their specs
        differ; each worker allocates with its own specs and this block count.
        """
        configs = self.collective_rpc(Worker.determine_kv_cache_config, budget_bytes)
        return with_num_blocks(configs[0], min(c.num_blocks for c in configs))

    def initialize_kv_cache(self, kv_config: KVCacheConfig) -> None:
        self.collective_rpc(Worker.initialize_kv_cache, kv_config)  # each rank keeps its own specs

    def execute_on_workers(self, scheduler_output: SchedulerOutput) -> list[ModelRunnerOutput]:
        return self.collective_rpc(Worker.execute_model, scheduler_output)

    def capture_stats(self) -> list[CaptureStats]:
        return self.collective_rpc(Worker.capture_stats)

    def use_capture(self, decision: CaptureDecision) -> None:
        self.collective_rpc(Worker.use_capture, decision)

    def kv_memory_usage(self) -> list[KVMemoryUsage]:
        return self.collective_rpc(Worker.kv_memory_usage)

    def shutdown(self) -> None:
        try:
            if all(p.poll() is None for p in self.procs):
                self.collective_rpc(Worker.shutdown)
        except (WorkerError, OSError):
            logger.warning("workers did not shut down cleanly")
        self._kill_ranks()

    def _kill_ranks(self) -> None:
        """Close the connections (a rank waiting for a call exits), then wait, then kill."""
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
