"""MultiConnector: several connectors behind one, e.g. an offload tier beside P/D transfer.

`kv_connector_extra_config = {"connectors": [cfg, ...]}` where each cfg is a
--kv-transfer-config object (kv_role and kv_load_failure_policy default to the parent's).

- Loads: the children are asked in order; the first with a hit (count > 0) loads the
  request, the others are told of the allocation with zero external tokens (they still
  learn the block table, e.g. to save the blocks). A child that cannot tell yet (None)
  defers the request.
- Saves: every child sees every hook, so every child saves.
- Metadata: MultiMetadata, the list of the children's metadata (each child's worker half
  is bound to its own), plus which children delayed the free of each finished request.
- Outputs: merged; a request is reported in finished_sending once every child that
  delayed its free reported it (per worker; the executor then counts workers as usual).
  Failures and invalid blocks are unioned, stats summed by key, events concatenated.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvferry.config import ConnectorSpec, KVTransferConfig
from kvferry.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    ServedInstance,
    connector_class,
)
from kvferry.errors import ConfigError
from kvferry.messages.kv_connector import KVConnectorOutput, KVTransferParams

if TYPE_CHECKING:
    import torch

    from kvferry.config import EngineConfig
    from kvferry.kv.spec import KVCacheConfig
    from kvferry.messages.scheduler_output import BlockIds, SchedulerOutput
    from kvferry.model.forward_context import AttentionMetadata
    from kvferry.scheduler.request import Request

logger = logging.getLogger(__name__)


@dataclass
class MultiMetadata(KVConnectorMetadata):
    children: list[KVConnectorMetadata] = field(default_factory=list)
    # Requests finished since the last step whose free some children delayed: which ones.
    delayed: dict[str, tuple[int, ...]] = field(default_factory=dict)


def child_transfer_configs(parent: KVTransferConfig) -> list[KVTransferConfig]:
    """Each child's kv-transfer config, parsed and checked (ConfigError otherwise)."""
    extra = parent.kv_connector_extra_config
    unknown = set(extra) - {"connectors"}
    if unknown:
        raise ConfigError(f"MultiConnector: unknown keys {sorted(unknown)}; expected 'connectors'")
    raw = extra.get("connectors")
    if not isinstance(raw, list) or not raw:
        raise ConfigError("MultiConnector: 'connectors' must be a non-empty list of kv-transfer configs")
    configs = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not item.get("kv_connector"):
            raise ConfigError(f"MultiConnector: connectors[{i}] must be an object naming kv_connector")
        defaults = {"kv_role": parent.kv_role, "kv_load_failure_policy": parent.kv_load_failure_policy}
        try:
            configs.append(KVTransferConfig.from_dict({**defaults, **item}))
        except ConfigError as exc:
            raise ConfigError(f"MultiConnector: connectors[{i}]: {exc}") from exc
    return configs


def child_engine_config(engine_config: EngineConfig, child: ConnectorSpec) -> EngineConfig:
    """The engine config a child sees: its own connector and settings."""
    return dataclasses.replace(engine_config, kv_transfer=child.transfer, connector=child)


class MultiConnector(KVConnectorBase):
    def __init__(
        self,
        engine_config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        tp_rank: int = 0,
    ):
        super().__init__(engine_config, role, kv_cache_config, tp_rank)
        spec = engine_config.connector
        if spec is None:
            raise RuntimeError("MultiConnector: the engine config's connector is not resolved")
        self.children: list[KVConnectorBase] = [
            connector_class(child)(child_engine_config(engine_config, child), role, kv_cache_config, tp_rank)
            for child in spec.children
        ]
        self.graph_safe = all(child.graph_safe for child in self.children)
        self.has_layer_hooks = any(child.has_layer_hooks for child in self.children)
        # scheduler half
        self._load_child: dict[str, int] = {}  # req -> child that answered its last lookup
        self._delayed: dict[str, tuple[int, ...]] = {}  # to send in the next metadata
        # worker half
        self._waiting: dict[str, set[int]] = {}  # req -> children yet to report it sent
        self._early: dict[str, set[int]] = {}  # reports before the request's delay was known
        self._ready: set[str] = set()

    @classmethod
    def sub_connectors(cls, transfer_config: KVTransferConfig) -> list[KVTransferConfig]:
        return child_transfer_configs(transfer_config)

    @classmethod
    def settle(
        cls, spec: ConnectorSpec, engine_config: EngineConfig, served: ServedInstance | None
    ) -> ConnectorSpec:
        """Each child's start-up decisions, in its own spec."""
        children = tuple(
            connector_class(child).settle(child, child_engine_config(engine_config, child), served)
            for child in spec.children
        )
        return dataclasses.replace(spec, children=children)

    @classmethod
    def expected_finished_count(cls, engine_config: EngineConfig) -> int:
        spec = engine_config.connector
        assert spec is not None, "MultiConnector: the engine config's connector is not resolved"
        counts = {
            connector_class(child).expected_finished_count(child_engine_config(engine_config, child))
            for child in spec.children
        }
        if len(counts) != 1:
            raise ConfigError(f"MultiConnector: children expect different worker quorums {sorted(counts)}")
        return counts.pop()

    @classmethod
    def validate_kv_transfer_params(cls, spec: ConnectorSpec, params: KVTransferParams | None) -> None:
        for child in spec.children:
            connector_class(child).validate_kv_transfer_params(child, params)

    # ---- scheduler half -------------------------------------------------------------

    def request_added(self, request: Request) -> None:
        for child in self.children:
            child.request_added(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._load_child.pop(request.req_id, None)
        for i, child in enumerate(self.children):
            num, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if num is None:
                return None, False
            if num > 0:
                self._load_child[request.req_id] = i
                return num, load_async
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: BlockIds, num_external: int) -> None:
        chosen = self._load_child.pop(request.req_id, None)
        for i, child in enumerate(self.children):
            child.update_state_after_alloc(request, block_ids, num_external if i == chosen else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiMetadata:
        meta = MultiMetadata([child.build_connector_meta(scheduler_output) for child in self.children])
        meta.delayed, self._delayed = self._delayed, {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for child in self.children:
            child.update_connector_output(output)

    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, KVTransferParams | None]:
        self._load_child.pop(request.req_id, None)
        delayed, params = [], None
        for i, child in enumerate(self.children):
            delay, child_params = child.request_finished(request, block_ids)
            if delay:
                delayed.append(i)
            if child_params:
                params = {**(params or {}), **child_params}
        if delayed:
            self._delayed[request.req_id] = tuple(delayed)
        return bool(delayed), params

    def release_kept(self, request_ids: list[str]) -> None:
        for child in self.children:
            child.release_kept(request_ids)

    # ---- worker half ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> None:
        for child in self.children:
            child.register_kv_caches(kv_caches, kv_cache_config)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, MultiMetadata), f"not MultiConnector metadata: {metadata!r}"
        assert len(metadata.children) == len(self.children)
        super().bind_connector_metadata(metadata)
        for child, child_meta in zip(self.children, metadata.children):
            child.bind_connector_metadata(child_meta)
        for req_id, children in metadata.delayed.items():
            remaining = set(children) - self._early.pop(req_id, set())
            if remaining:
                self._waiting[req_id] = remaining
            else:
                self._ready.add(req_id)

    def clear_connector_metadata(self) -> None:
        for child in self.children:
            child.clear_connector_metadata()
        super().clear_connector_metadata()

    def _each(self, hook: Callable[[KVConnectorBase], None]) -> None:
        """Run a hook on every child; the first error is raised after all of them ran."""
        error: Exception | None = None
        for child in self.children:
            try:
                hook(child)
            except Exception as exc:
                logger.exception("a hook of %s failed", type(child).__name__)
                error = error or exc
        if error is not None:
            raise error

    def start_load_kv(self) -> None:
        self._each(lambda child: child.start_load_kv())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._each(lambda child: child.wait_for_layer_load(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn: AttentionMetadata) -> None:
        self._each(lambda child: child.save_kv_layer(layer_name, kv_layer, attn))

    def wait_for_save(self) -> None:
        self._each(lambda child: child.wait_for_save())

    def collect_output(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        merged = KVConnectorOutput()
        for i, child in enumerate(self.children):
            out = child.collect_output(finished_req_ids)
            self._count_sent(i, out.finished_sending, merged.finished_sending)
            merged.finished_recving |= out.finished_recving
            merged.failed_recving |= out.failed_recving
            merged.invalid_block_ids |= out.invalid_block_ids
            merged.remote_first_tokens.update(out.remote_first_tokens)
            merged.events.extend(out.events)
            if out.stats is not None:
                merged.stats = out.stats if merged.stats is None else merged.stats.aggregate(out.stats)
        merged.finished_sending |= self._ready
        self._ready = set()
        for req_id in finished_req_ids:  # finished without a delayed free: nothing to wait for
            if req_id not in self._waiting:
                self._early.pop(req_id, None)
        return merged

    def _count_sent(self, child: int, reported: set[str], done: set[str]) -> None:
        for req_id in reported:
            waiting = self._waiting.get(req_id)
            if waiting is None:
                self._early.setdefault(req_id, set()).add(child)
                continue
            waiting.discard(child)
            if not waiting:
                del self._waiting[req_id]
                done.add(req_id)

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()
