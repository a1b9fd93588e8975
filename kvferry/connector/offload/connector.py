"""OffloadConnector: KV blocks of computed prompts to a CPU DRAM tier and a disk tier.

The scheduler half (OffloadScheduler) owns the index and decides every load, save,
demotion and eviction; the worker half (OffloadWorker) moves the bytes. See
kvferry/connector/offload/README.md for the design, the config and the stats.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar

from kvferry.connector.base import KVConnectorBase, KVConnectorRole, ServedInstance
from kvferry.connector.offload.config import OffloadConfig
from kvferry.connector.offload.metadata import OffloadMetadata
from kvferry.connector.offload.scheduler_side import OffloadScheduler
from kvferry.connector.offload.worker_side import OffloadWorker
from kvferry.messages.kv_connector import KVConnectorOutput, KVConnectorStats, KVTransferParams

if TYPE_CHECKING:
    import torch

    from kvferry.config import ConnectorSpec, EngineConfig
    from kvferry.kv.spec import KVCacheConfig
    from kvferry.messages.scheduler_output import BlockIds, SchedulerOutput
    from kvferry.model.forward_context import AttentionMetadata
    from kvferry.scheduler.request import Request

logger = logging.getLogger(__name__)


class OffloadConnector(KVConnectorBase):
    # Every kv_role (the base's default): the tiers are local to this instance and serve it
    # whatever its P/D role (e.g. beside a NixlConnector in a MultiConnector).
    # Whole-request transfer (the default): loads happen before the forward, saves after it,
    # no per-layer work. With `layerwise` an instance declares per-layer hooks (set in
    # __init__): plain Python on the worker's own threads, safe inside a compiled graph.
    graph_safe = True
    has_layer_hooks = False
    # The worker half's implementation (tests subclass it to inject failures).
    worker_class: ClassVar[type[OffloadWorker]] = OffloadWorker

    def __init__(
        self,
        engine_config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        tp_rank: int = 0,
    ):
        super().__init__(engine_config, role, kv_cache_config, tp_rank)
        self.offload_config = OffloadConfig.from_extra(self.extra_config)
        self.has_layer_hooks = self.offload_config.layerwise
        self.scheduler: OffloadScheduler | None = None
        self.worker: OffloadWorker | None = None
        heads = engine_config.model.num_kv_heads
        if role is KVConnectorRole.SCHEDULER:
            self.scheduler = OffloadScheduler(self.offload_config, kv_cache_config, heads, self.tp_size)
        else:
            self.worker = self.worker_class(
                self.offload_config, kv_cache_config, heads, self.tp_size, tp_rank
            )

    @classmethod
    def settle(
        cls, spec: ConnectorSpec, engine_config: EngineConfig, served: ServedInstance | None
    ) -> ConnectorSpec:
        """Check the extra config once, before any worker loads the model (ConfigError)."""
        OffloadConfig.from_extra(spec.transfer.kv_connector_extra_config)
        return spec

    # ---- scheduler half -------------------------------------------------------------

    def _sched(self) -> OffloadScheduler:
        assert self.scheduler is not None, "scheduler-half hook called on the worker half"
        return self.scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._sched().num_matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, block_ids: BlockIds, num_external: int) -> None:
        self._sched().after_alloc(request, block_ids, num_external)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        return self._sched().build_meta(scheduler_output)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._sched().update_output(output)

    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, KVTransferParams | None]:
        return self._sched().finished(request), None

    # ---- worker half ----------------------------------------------------------------

    def _work(self) -> OffloadWorker:
        assert self.worker is not None, "worker-half hook called on the scheduler half"
        return self.worker

    def _meta(self) -> OffloadMetadata:
        meta = self.metadata
        assert isinstance(meta, OffloadMetadata), f"not offload metadata: {type(meta).__name__}"
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> None:
        self._work().register(kv_caches, kv_cache_config)

    def start_load_kv(self) -> None:
        self._work().start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn: AttentionMetadata) -> None:
        self._work().save_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        self._work().submit_ops(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return self._work().finished_sending(finished_req_ids, self._meta().idle), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def get_stats(self) -> KVConnectorStats | None:
        data = self._work().take_stats()
        return KVConnectorStats(data) if data else None

    def collect_output(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        output = super().collect_output(finished_req_ids)
        output.events.extend(self._work().take_events())
        return output

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
