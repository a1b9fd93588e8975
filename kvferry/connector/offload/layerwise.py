"""Layer-wise offload: loads and saves that follow the forward layer by layer.

A slot row holds, per KV cache group, one page of every KV tensor serving one of its
layers (`blocks.BlockCopier`'s segments). `LayerPlan` says which segments become needed
before each layer's attention (a segment's first member layer, in the order the model
registered its layers) and which are final after each layer's `save_kv_layer` (its last
member layer).

- Loads: at step start the worker hands the step's loads to `LayerLoader`, whose thread
  reads each layer's byte ranges from the tiers and copies them into the device blocks, in
  layer order; `wait_for_layer_load(layer)` waits only until that layer's pages are in, so
  the later layers' reads overlap the earlier layers' compute (the uncached suffix).
- Saves: `save_kv_layer(layer)` queues, on the worker's save thread, the copy of the pages
  that layer just finished into staging rows (`StagedSaves`); after the forward the
  step's tier writes use those rows instead of reading the device blocks again.

A load that fails its check fails the whole load (every page reported as a load error), as
a whole-request load does; the layers copied before the failure are not trusted either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvferry.connector.offload.blocks import BlockCopier
from kvferry.connector.offload.jobs import JobQueue
from kvferry.connector.offload.metadata import OffloadMetadata, SaveOp

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerPlan:
    """Which row segments each layer's hooks move (indices into `BlockCopier.segments`)."""

    load_steps: tuple[tuple[str, tuple[int, ...]], ...]  # (layer, segments needed first there)
    save_at: dict[str, tuple[int, ...]]  # layer -> segments final once it saved

    @classmethod
    def build(cls, copier: BlockCopier, layer_order: list[str]) -> LayerPlan:
        position = {layer: i for i, layer in enumerate(layer_order)}
        first: dict[str, list[int]] = {layer: [] for layer in layer_order}
        last: dict[str, list[int]] = {}
        for index, segment in enumerate(copier.segments):
            members = sorted(segment.layers, key=position.__getitem__)
            first[members[0]].append(index)
            last.setdefault(members[-1], []).append(index)
        steps = tuple((layer, tuple(first[layer])) for layer in layer_order)
        return cls(steps, {layer: tuple(segs) for layer, segs in last.items()})

    @property
    def load_index(self) -> dict[str, int]:
        return {layer: i for i, (layer, _) in enumerate(self.load_steps)}


# A step's load job: given a callback that marks layers done (by load step), it copies the
# layers in order and returns, per load, whether it succeeded.
LoadJob = Callable[[Callable[[int], None]], list[bool]]


class LayerLoader:
    """Runs one step's layer-wise loads on a thread of its own; the forward waits per layer."""

    def __init__(self, plan: LayerPlan, name: str):
        self.plan = plan
        self._index = plan.load_index
        self._jobs = JobQueue(name)
        self._cond = threading.Condition()
        self._layers_done = 0
        self._seq = 0  # the step's job (0: no loads in flight)
        self._result: list[bool] = []

    @property
    def active(self) -> bool:
        return self._seq != 0

    def start(self, job: LoadJob, num_loads: int) -> None:
        assert not self.active, "the previous step's loads were not finished"
        with self._cond:
            self._layers_done = 0
        self._result = [False] * num_loads

        def run() -> None:
            try:
                with torch.inference_mode():  # the staging rows and KV are inference tensors
                    self._result = job(self._advance)
            except Exception:
                logger.exception("offload: a layer-wise load failed")
            finally:
                self._advance(len(self.plan.load_steps))  # no waiter is left hanging

        self._seq = self._jobs.submit(run)

    def _advance(self, layers_done: int) -> None:
        with self._cond:
            self._layers_done = max(self._layers_done, layers_done)
            self._cond.notify_all()

    def wait(self, layer: str) -> float:
        """Block until `layer`'s pages are in its device blocks; the seconds waited."""
        index = self._index.get(layer)
        if not self.active or index is None:
            return 0.0
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._layers_done > index)
        return time.perf_counter() - start

    def finish(self) -> list[bool] | None:
        """Wait for the step's job; per load, whether it succeeded (None: no loads ran)."""
        if not self.active:
            return None
        self._jobs.wait(self._seq)
        self._seq = 0
        return self._result

    def close(self) -> None:
        self.finish()
        self._jobs.close()


@dataclass
class StagedSaves:
    """A step's saves, copied into `rows` layer by layer as the forward finishes each one."""

    meta: OffloadMetadata
    saves: list[SaveOp]
    rows: torch.Tensor  # [len(saves), slot_bytes]
    staged_layers: set[str] = field(default_factory=set)

    def row_of(self) -> dict[SaveOp, int]:
        return {op: k for k, op in enumerate(self.saves)}

    def rows_for(self, batch: list[SaveOp], positions: dict[SaveOp, int]) -> torch.Tensor:
        index = [positions[op] for op in batch]
        if index == list(range(index[0], index[0] + len(index))):
            return self.rows[index[0] : index[0] + len(index)]
        return self.rows[index]
