"""NixlConnector: P/D disaggregation by pulling KV over NIXL (DESIGN.md section 5).

    kv_role producer  prefill instance: finished prefills that asked for remote decode
                      keep their blocks under a lease until the decoder has read them
    kv_role consumer  decode instance: requests with do_remote_prefill read the remote
                      blocks (beyond the local prefix hit) before they run
    kv_role both      either, per request

One class, two halves: the scheduler half is scheduler_side.NixlScheduler, the worker
half worker_side.NixlWorker; this class routes the connector API to them. See
docs/connector.md (NixlConnector) for the kv_transfer_params contract and the settings.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import TYPE_CHECKING

from kvferry.config import KVRole
from kvferry.connector.base import KVConnectorBase, KVConnectorRole, ServedInstance
from kvferry.connector.nixl.auth import PeerAuth, process_secret, warn_without_secret
from kvferry.connector.nixl.metadata import NixlConnectorMetadata, NixlSettings
from kvferry.connector.nixl.params import validate_params
from kvferry.connector.nixl.serving import refuse_unauthenticated, served_extra
from kvferry.kv.spec import KVCacheConfig
from kvferry.messages.kv_connector import KVConnectorOutput, KVConnectorStats, KVTransferParams
from kvferry.ports import free_port

if TYPE_CHECKING:
    import torch

    from kvferry.config import ConnectorSpec, EngineConfig
    from kvferry.connector.nixl.scheduler_side import NixlScheduler
    from kvferry.connector.nixl.worker_side import NixlWorker
    from kvferry.messages.scheduler_output import SchedulerOutput
    from kvferry.model.forward_context import AttentionMetadata
    from kvferry.scheduler.request import Request

logger = logging.getLogger(__name__)


class NixlConnector(KVConnectorBase):
    # Loads finish before their request runs and holds start after the forward, except on a
    # layer-wise prefiller, whose save_kv_layer records a streamed prefill's layer as final
    # (a list append, safe to capture); everywhere else the per-layer hooks do nothing.
    graph_safe = True
    has_layer_hooks = False
    takes_secret_file = True  # the side channel's (auth.py)

    def __init__(
        self,
        engine_config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        tp_rank: int = 0,
    ):
        super().__init__(engine_config, role, kv_cache_config, tp_rank)
        self.settings = NixlSettings.from_extra(self.extra_config)
        auth = PeerAuth(process_secret(self.settings.secret_file) or b"", self.settings.engine_id)
        self.scheduler: NixlScheduler | None = None
        self.worker: NixlWorker | None = None
        self._failed: set[str] = set()
        self._stats: dict[str, float] = {}
        self._first_tokens: dict[str, int] = {}
        self.has_layer_hooks = self.settings.layerwise and self.transfer_config.kv_role is not KVRole.CONSUMER
        if role is KVConnectorRole.SCHEDULER:
            from kvferry.connector.nixl.scheduler_side import NixlScheduler

            self.scheduler = NixlScheduler(engine_config, kv_cache_config, self.settings, auth)
        else:
            from kvferry.connector.nixl.worker_side import NixlWorker

            self.worker = NixlWorker(engine_config, self.settings, tp_rank, auth)

    @classmethod
    def settle(
        cls, spec: ConnectorSpec, engine_config: EngineConfig, served: ServedInstance | None
    ) -> ConnectorSpec:
        """Pick the engine id and the side-channel port once, for every half and rank; on a
        served instance, also where the side channel binds and its secret (serving.py)."""
        transfer = spec.transfer
        extra = dict(transfer.kv_connector_extra_config)
        if served is not None:
            extra = served_extra(extra, served)
        extra.setdefault("engine_id", f"kvf-{uuid.uuid4().hex[:12]}")
        if not extra.get("side_channel_port") and transfer.kv_role is not KVRole.CONSUMER:
            extra["side_channel_port"] = free_port(extra.get("side_channel_host", "127.0.0.1"))
        settings = NixlSettings.from_extra(extra)  # a bad setting fails the start-up, clearly
        if process_secret(settings.secret_file) is None:  # an unreadable secret fails it too
            refuse_unauthenticated(served)
            warn_without_secret(settings.engine_id)
        transfer = dataclasses.replace(transfer, kv_connector_extra_config=extra)
        return dataclasses.replace(spec, transfer=transfer)

    @classmethod
    def stream_source(cls, spec: ConnectorSpec, engine_config: EngineConfig) -> KVTransferParams | None:
        """A layer-wise prefill instance's side channel, for decode requests' params."""
        settings = NixlSettings.from_extra(spec.transfer.kv_connector_extra_config)
        if spec.transfer.kv_role is KVRole.CONSUMER or not settings.layerwise:
            return None
        return {
            "do_remote_prefill": True,
            "remote_engine_id": settings.engine_id,
            "remote_host": settings.side_channel_host,
            "remote_port": settings.side_channel_port,
            "remote_tp_size": engine_config.parallel.tensor_parallel_size,
        }

    @classmethod
    def validate_kv_transfer_params(cls, spec: ConnectorSpec, params: KVTransferParams | None) -> None:
        validate_params(spec.transfer.kv_role, params)

    @property
    def _scheduler(self) -> NixlScheduler:
        if self.scheduler is None:
            raise RuntimeError("a scheduler-half call on the NixlConnector's worker half")
        return self.scheduler

    @property
    def _worker(self) -> NixlWorker:
        if self.worker is None:
            raise RuntimeError("a worker-half call on the NixlConnector's scheduler half")
        return self.worker

    # ---- scheduler half -------------------------------------------------------------

    def request_added(self, request: Request) -> None:
        self._scheduler.request_added(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, block_ids, num_external)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._scheduler.force_first_tokens(output.remote_first_tokens)  # before they become runnable
        self._scheduler.update_connector_output(set(output.finished_recving), set(output.failed_recving))

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, KVTransferParams | None]:
        return self._scheduler.request_finished(request, block_ids)

    def release_kept(self, request_ids: list[str]) -> None:
        self._scheduler.release_kept(request_ids)

    # ---- worker half ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> None:
        self._worker.register(kv_caches, kv_cache_config)

    def start_load_kv(self) -> None:
        meta = self.metadata
        assert isinstance(meta, NixlConnectorMetadata), f"bad metadata {meta!r}"
        self._worker.start_load(meta)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn: AttentionMetadata) -> None:
        meta = self.metadata
        assert isinstance(meta, NixlConnectorMetadata), f"bad metadata {meta!r}"
        self._worker.layer_saved(layer_name, meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, recving, self._failed, stats, self._first_tokens = self._worker.take()
        self._stats = stats
        return sending, recving

    def get_remote_first_tokens(self) -> dict[str, int]:
        tokens, self._first_tokens = self._first_tokens, {}
        return tokens

    def get_failed_recving(self) -> set[str]:
        failed, self._failed = self._failed, set()
        return failed

    def get_stats(self) -> KVConnectorStats | None:
        stats, self._stats = self._stats, {}
        return KVConnectorStats(stats) if stats else None

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
