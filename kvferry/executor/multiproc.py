"""Executor with one worker process per tensor-parallel rank (torch.distributed: gloo/NCCL).

The RPC surface is small and typed: a WorkerCall names one of the Worker methods in
WORKER_METHODS; each process answers with a WorkerReply carrying the result or the
error text. Every call goes to every rank; replies come back in rank order.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvferry.config import EngineConfig
from kvferry.errors import KVFerryError
from kvferry.executor.base import Executor
from kvferry.kv.allocate import with_num_blocks
from kvferry.kv.spec import KVCacheConfig
from kvferry.scheduler.output import SchedulerOutput
from kvferry.worker.capture import CaptureStats
from kvferry.worker.memory_profile import MemoryProfile
from kvferry.worker.output import ModelRunnerOutput

logger = logging.getLogger(__name__)

WORKER_METHODS = frozenset(
    {
        "prepare_memory_profile",
        "finish_memory_profile",
        "determine_kv_cache_config",
        "initialize_kv_cache",
        "execute_model",
        "capture_stats",
        "shutdown",
    }
)
STARTUP_TIMEOUT_S = 600


class WorkerError(KVFerryError, RuntimeError):
    """A worker process failed or died."""


@dataclass
class WorkerCall:
    method: str
    args: tuple = ()


@dataclass
class WorkerReply:
    rank: int
    result: Any = None
    error: str | None = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(rank: int, world_size: int, port: int, device: str):
    import torch
    import torch.distributed as dist

    from kvferry.model.layers.parallel import TPGroup

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    return TPGroup(rank=rank, size=world_size, group=dist.group.WORLD)


def _worker_main(rank: int, world_size: int, port: int, config: EngineConfig, conn: Connection) -> None:
    """Entry point of a worker process: build the Worker, then serve calls until shutdown."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s"
    )
    try:
        from kvferry.worker.worker import Worker

        device = f"cuda:{rank}" if config.device.startswith("cuda") else config.device
        tp = init_distributed(rank, world_size, port, device)
        worker = Worker(config, tp)
        conn.send(WorkerReply(rank))
    except Exception:
        conn.send(WorkerReply(rank, error=traceback.format_exc()))
        return
    _serve(worker, rank, conn)


def _serve(worker, rank: int, conn: Connection) -> None:
    while True:
        try:
            call: WorkerCall = conn.recv()
        except EOFError:  # the executor went away
            break
        assert call.method in WORKER_METHODS, call.method
        try:
            result = getattr(worker, call.method)(*call.args)
            conn.send(WorkerReply(rank, result))
        except Exception:
            conn.send(WorkerReply(rank, error=traceback.format_exc()))
        if call.method == "shutdown":
            break


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.world_size = config.parallel.tensor_parallel_size
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns: list[Connection] = []
        self.procs: list[mp.Process] = []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, config, child),
                daemon=True,
                name=f"kvferry-tp{rank}",
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self._gather(timeout=STARTUP_TIMEOUT_S)
        logger.info("started %d worker processes", self.world_size)

    def _gather(self, timeout: float | None = None) -> list[Any]:
        replies: list[WorkerReply] = []
        for rank, conn in enumerate(self.conns):
            if timeout is not None and not conn.poll(timeout):
                raise WorkerError(f"worker rank {rank} did not answer in {timeout}s")
            try:
                replies.append(conn.recv())
            except EOFError as exc:
                raise WorkerError(f"worker rank {rank} died (exit code {self.procs[rank].exitcode})") from exc
        errors = [r for r in replies if r.error]
        if errors:
            raise WorkerError(f"worker rank {errors[0].rank} failed:\n{errors[0].error}")
        return [r.result for r in replies]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        call = WorkerCall(method, args)
        for conn in self.conns:
            conn.send(call)
        return self._gather()

    def prepare_memory_profile(self, num_blocks: int) -> KVCacheConfig:
        return self.collective_rpc("prepare_memory_profile", num_blocks)[0]

    def finish_memory_profile(self) -> list[MemoryProfile]:
        return self.collective_rpc("finish_memory_profile")

    def determine_kv_cache_config(self, budget_bytes: int) -> KVCacheConfig:
        """Rank 0's specs (the scheduler's view) with the smallest block count of any rank.

        Ranks may cache different numbers of KV heads (uneven head split), so their specs
        differ; each worker allocates with its own specs and this block count.
        """
        configs = self.collective_rpc("determine_kv_cache_config", budget_bytes)
        return with_num_blocks(configs[0], min(c.num_blocks for c in configs))

    def initialize_kv_cache(self, kv_config: KVCacheConfig) -> None:
        self.collective_rpc("initialize_kv_cache", kv_config)  # each rank keeps its own specs

    def execute_on_workers(self, scheduler_output: SchedulerOutput) -> list[ModelRunnerOutput]:
        return self.collective_rpc("execute_model", scheduler_output)

    def capture_stats(self) -> list[CaptureStats]:
        return self.collective_rpc("capture_stats")

    def shutdown(self) -> None:
        try:
            if all(p.is_alive() for p in self.procs):
                self.collective_rpc("shutdown")
        except (WorkerError, OSError, BrokenPipeError):
            logger.warning("workers did not shut down cleanly")
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
