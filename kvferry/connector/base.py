"""The KV connector API: one class, two halves (see docs/connector.md for the call order).

The scheduler half runs in the engine core next to the Scheduler: it decides what to
load and save and builds per-step metadata. The worker half runs in every worker: it
moves bytes. The two halves are separate instances of the same class, built with
different roles, and talk only through the metadata (scheduler -> worker) and
KVConnectorOutput (worker -> scheduler).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvferry.config import ConnectorSpec, KVRole
from kvferry.errors import KVFerryError
from kvferry.kv.spec import KVCacheConfig, Layout
from kvferry.messages.kv_connector import KVConnectorOutput, KVConnectorStats, KVTransferParams

if TYPE_CHECKING:  # torch types the worker half's arguments; resolving a connector needs none
    import torch

    from kvferry.config import EngineConfig, KVTransferConfig, LoadFailurePolicy
    from kvferry.messages.scheduler_output import BlockIds, SchedulerOutput
    from kvferry.model.forward_context import AttentionMetadata
    from kvferry.scheduler.request import Request

logger = logging.getLogger(__name__)


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class MetadataNotBoundError(KVFerryError, RuntimeError):
    """Connector metadata was read outside a forward (invariant 1)."""


@dataclass
class KVConnectorMetadata:
    """Base of the per-step scheduler -> worker message; connectors subclass it."""


@dataclass(frozen=True)
class ServedInstance:
    """What `kvferry serve` tells the connector when it settles its settings: the HTTP
    host, the shared-secret file given on the command line, whether the API has a key."""

    host: str
    kv_secret_file: str | None = None
    has_api_key: bool = False


class KVConnectorBase:
    """Base class. Subclasses override the hooks they need; defaults do nothing."""

    # The roles this connector can take.
    supported_roles: ClassVar[frozenset[KVRole]] = frozenset(KVRole)
    # Invariant 2: may the per-layer hooks be captured in a graph (compiled CPU, CUDA)?
    # (This and has_layer_hooks are declared per class; MultiConnector sets its own per
    # instance, from the children it was built with.)
    graph_safe: bool = False
    # Invariant 5: the KV layouts this connector works with. The engine uses --kv-layout as
    # given; a connector that cannot work with it refuses the start-up (every built-in one
    # and both allocators work with either).
    supported_layouts: ClassVar[tuple[Layout, ...]] = (Layout.NHD, Layout.HND)
    # Does it read a shared secret (ServedInstance.kv_secret_file, --kv-transfer-secret-file)?
    takes_secret_file: ClassVar[bool] = False
    # Invariant 2: do the per-layer hooks (wait_for_layer_load, save_kv_layer) do anything?
    # A connector whose hooks do nothing declares False and costs nothing per layer: no
    # call, no graph operator. Undeclared, it is True exactly when the class overrides a hook.
    has_layer_hooks: bool = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "has_layer_hooks" not in cls.__dict__:
            overrides = any(hook in cls.__dict__ for hook in ("wait_for_layer_load", "save_kv_layer"))
            cls.has_layer_hooks = cls.has_layer_hooks or overrides

    def __init__(
        self,
        engine_config: EngineConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
        tp_rank: int = 0,
    ):
        self.engine_config = engine_config
        self.transfer_config: KVTransferConfig = engine_config.kv_transfer
        self.role = role
        self.kv_cache_config = kv_cache_config
        self.tp_rank = tp_rank  # the worker's tensor-parallel rank (0 for the scheduler half)
        self.tp_size = engine_config.parallel.tensor_parallel_size
        self._metadata: KVConnectorMetadata | None = None

    @property
    def extra_config(self) -> dict[str, Any]:
        return self.transfer_config.kv_connector_extra_config

    # ---- scheduler half: kvferry.scheduler.interfaces.SchedulerConnector states the
    # contract of each of these; the defaults below claim nothing and keep nothing. -------

    @property
    def load_failure_policy(self) -> LoadFailurePolicy:
        return self.transfer_config.kv_load_failure_policy

    def request_added(self, request: Request) -> None:
        return None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, KVTransferParams | None]:
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        return None

    def release_kept(self, request_ids: list[str]) -> None:
        return None

    @classmethod
    def sub_connectors(cls, transfer_config: KVTransferConfig) -> list[KVTransferConfig]:
        """The settings of the connectors this one is made of, resolved with it (MultiConnector's
        children); raise ConfigError for malformed ones. Default: none."""
        return []

    @classmethod
    def settle(
        cls, spec: ConnectorSpec, engine_config: EngineConfig, served: ServedInstance | None
    ) -> ConnectorSpec:
        """Decide, once per process and before any half is built, the settings every half and
        rank must agree on (an engine id, a port chosen at start-up; on a served instance,
        what `served` implies); raise ConfigError to refuse the start-up. Default: unchanged."""
        return spec

    @classmethod
    def stream_source(cls, spec: ConnectorSpec, engine_config: EngineConfig) -> KVTransferParams | None:
        """P/D, layer-wise: what a decode request needs, besides the transfer id, to stream
        this instance's prefills (the proxy asks for it: GET /v1/kv_transfer/source); None
        if this connector does not stream prefills."""
        return None

    @classmethod
    def validate_kv_transfer_params(cls, spec: ConnectorSpec, params: KVTransferParams | None) -> None:
        """Check a request's kv_transfer_params synchronously in the front end; raise
        InvalidRequestError (HTTP 400) for malformed ones. Default: accept anything."""

    @classmethod
    def expected_finished_count(cls, engine_config: EngineConfig) -> int:
        """How many workers must report a request finished (default: all of them)."""
        return engine_config.parallel.tensor_parallel_size

    # ---- worker half ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: KVCacheConfig) -> None:
        """The KV tensors (layer -> tensor; shared tensors appear under each member layer)."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, KVConnectorMetadata), f"bad connector metadata {metadata!r}"
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @property
    def metadata(self) -> KVConnectorMetadata:
        if self._metadata is None:
            raise MetadataNotBoundError(f"{type(self).__name__}: connector metadata read outside a forward")
        return self._metadata

    def start_load_kv(self) -> None:
        """Before the forward (also on an empty step): start or do the loads the metadata asks for."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before a layer's attention: its KV must be in place."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn: AttentionMetadata) -> None:
        """After a layer wrote this step's KV: start saving what the metadata asks for."""

    def wait_for_save(self) -> None:
        """After the forward: saves started this step are safely under way."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) request ids, since the last call."""
        return set(), set()

    def get_failed_recving(self) -> set[str]:
        return set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def get_stats(self) -> KVConnectorStats | None:
        return None

    def get_remote_first_tokens(self) -> dict[str, int]:
        """P/D: first tokens a remote prefiller sent with KV received (KVConnectorOutput)."""
        return {}

    def shutdown(self) -> None:
        """Release resources (threads, agents, files)."""

    # ---- framework helpers ----------------------------------------------------------

    def collect_output(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            failed_recving=self.get_failed_recving(),
            invalid_block_ids=self.get_block_ids_with_load_errors(),
            stats=self.get_stats(),
            remote_first_tokens=self.get_remote_first_tokens(),
        )

    @contextmanager
    def bound(self, metadata: KVConnectorMetadata) -> Iterator[None]:
        """Bind metadata for exactly one forward."""
        self.bind_connector_metadata(metadata)
        try:
            yield
        finally:
            self.clear_connector_metadata()


def connector_class(spec: ConnectorSpec) -> type[KVConnectorBase]:
    """The class of a resolved connector (checked when it was resolved)."""
    cls = spec.connector_class
    assert issubclass(cls, KVConnectorBase), f"{cls!r} is not a KV connector"
    return cls
