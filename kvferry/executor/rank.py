"""What every multi-rank executor shares: the rendezvous, building a rank's Worker, and
the typed calls a rank answers.

A call names a Worker method by the method object itself (`Worker.execute_model`), not by
its name: a typo is an AttributeError where the call is written, and a rank only runs
methods in WORKER_METHODS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvferry.config import EngineConfig
from kvferry.worker.worker import Worker

if TYPE_CHECKING:
    from kvferry.model.layers.parallel import TPGroup

WorkerMethod = Callable[..., Any]
R = TypeVar("R")  # what a Worker method returns: collective calls return one per rank

WORKER_METHODS: frozenset[WorkerMethod] = frozenset(
    {
        Worker.prepare_memory_profile,
        Worker.finish_memory_profile,
        Worker.free_memory,
        Worker.determine_kv_cache_config,
        Worker.initialize_kv_cache,
        Worker.execute_model,
        Worker.capture_stats,
        Worker.use_capture,
        Worker.kv_memory_usage,
        Worker.shutdown,
    }
)


@dataclass(frozen=True)
class WorkerCall:
    """One call of a Worker method on a rank; functions pickle by reference."""

    method: WorkerMethod
    args: tuple[Any, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.method not in WORKER_METHODS:
            raise ValueError(f"{self.method!r} is not a method a rank answers")

    def run(self, worker: Worker) -> Any:
        return self.method(worker, *self.args)


@dataclass(frozen=True)
class WorkerReply:
    """A rank's answer to a call: the result, or the error's traceback text. (Defined
    here, not in rank_process, which runs as __main__ and would pickle it as such.)"""

    rank: int
    result: Any = None
    error: str | None = None


@dataclass(frozen=True)
class RankSetup:
    """What a rank needs to build its Worker."""

    rank: int
    world_size: int
    port: int  # torch.distributed's TCP rendezvous on 127.0.0.1
    config: EngineConfig


def init_distributed(rank: int, world_size: int, port: int, device: str) -> TPGroup:
    import torch
    import torch.distributed as dist

    from kvferry.model.layers.parallel import TPGroup

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    return TPGroup(rank=rank, size=world_size, group=dist.group.WORLD)


def build_worker(setup: RankSetup) -> Worker:
    config = setup.config
    device = f"cuda:{setup.rank}" if config.device.startswith("cuda") else config.device
    tp = init_distributed(setup.rank, setup.world_size, setup.port, device)
    return Worker(config, tp)
