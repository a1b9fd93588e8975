"""RecordingConnector: moves nothing, records every hook call on both halves.

Each call appends one JSON line to `kv_connector_extra_config["record_path"]` (append
mode, so worker processes and the engine core can share the file): the role, the hook,
the step the metadata belongs to (worker half: read through `self.metadata`, which
raises outside a forward), and the process id. Tests use it to prove invariant 1 and
the documented hook order; it is also a debugging aid.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvferry.connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from kvferry.kv.spec import KVCacheConfig
from kvferry.messages.kv_connector import KVConnectorOutput, KVTransferParams

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.messages.scheduler_output import BlockIds, SchedulerOutput
    from kvferry.model.forward_context import AttentionMetadata
    from kvferry.scheduler.request import Request


@dataclass
class RecordingMetadata(KVConnectorMetadata):
    step: int
    num_scheduled_tokens: int


class RecordingConnector(KVConnectorBase):
    graph_safe = True

    def __init__(
        self,
        engine_config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        tp_rank: int = 0,
    ):
        super().__init__(engine_config, role, kv_cache_config, tp_rank)
        self.path: str | None = self.extra_config.get("record_path")
        self.step = 0

    def _record(self, hook: str, **fields: object) -> None:
        if self.path is None:
            return
        line = {"role": self.role.value, "hook": hook, "pid": os.getpid(), **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def _step(self) -> int:
        metadata = self.metadata  # raises MetadataNotBoundError outside a forward
        assert isinstance(metadata, RecordingMetadata)
        return metadata.step

    # scheduler half
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._record("get_num_new_matched_tokens", req=request.req_id)
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: BlockIds, num_external: int) -> None:
        self._record("update_state_after_alloc", req=request.req_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RecordingMetadata:
        assert self.role is KVConnectorRole.SCHEDULER
        self.step += 1
        self._record(
            "build_connector_meta", step=self.step, tokens=scheduler_output.total_num_scheduled_tokens
        )
        return RecordingMetadata(self.step, scheduler_output.total_num_scheduled_tokens)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._record("update_connector_output")

    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, KVTransferParams | None]:
        self._record("request_finished", req=request.req_id)
        return False, None

    # worker half
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> None:
        self._record("register_kv_caches", layers=len(kv_caches))

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        self._record("bind_connector_metadata", step=self._step())

    def clear_connector_metadata(self) -> None:
        self._record("clear_connector_metadata", step=self._step())
        super().clear_connector_metadata()

    def start_load_kv(self) -> None:
        self._record("start_load_kv", step=self._step())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._record("wait_for_layer_load", step=self._step(), layer=layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn: AttentionMetadata) -> None:
        self._record(
            "save_kv_layer", step=self._step(), layer=layer_name, tokens=int(attn.slot_mapping.numel())
        )

    def wait_for_save(self) -> None:
        self._record("wait_for_save", step=self._step())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self._record("get_finished", step=self._step())
        return set(), set()
