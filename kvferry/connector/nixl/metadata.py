"""Scheduler half -> worker half, once per step, and the connector's settings."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvferry.connector.base import KVConnectorMetadata
from kvferry.connector.nixl.leases import Finish, Hold
from kvferry.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSpec:
    """Read a remote prefill's blocks into a request's local blocks."""

    request_id: str  # local
    engine_id: str
    host: str
    port: int
    remote_request_id: str
    # per KV cache group: (local block ids, remote block ids), pairwise
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    fail: str | None = None  # do not read: report the load failed, for this reason
    streamed: bool = False  # layer-wise: read each layer once the prefiller says it is final


@dataclass
class NixlConnectorMetadata(KVConnectorMetadata):
    holds: list[Hold] = field(default_factory=list)  # prefills to keep for decoders
    loads: list[LoadSpec] = field(default_factory=list)  # remote KV to read
    cancels: list[str] = field(default_factory=list)  # loads whose request finished meanwhile
    releases: list[str] = field(default_factory=list)  # holds nobody will read: end their leases
    # Layer-wise, prefill side: requests whose prompt completes in this step's forward (its
    # save_kv_layer hooks mark their layers final), streamed prefills that finished, and
    # transfer ids whose prefill ended before it was held (transfer id, why).
    streams: list[str] = field(default_factory=list)
    finishes: list[Finish] = field(default_factory=list)
    forgotten: list[tuple[str, str]] = field(default_factory=list)

    @property
    def for_transfer_thread(self) -> bool:
        """Whether the transfer thread has anything to apply from it."""
        return bool(
            self.holds or self.loads or self.cancels or self.releases or self.finishes or self.forgotten
        )


_DEFAULTS: dict[str, object] = {
    "engine_id": None,  # chosen at start-up (NixlConnector.settle) when not given
    "side_channel_host": "127.0.0.1",
    "side_channel_port": 0,  # 0: a free port (kvferry.ports), chosen at start-up; TP rank r > 0 binds any free port
    "lease_s": 30.0,  # a finished prefill's blocks are kept this long for its decoder
    "heartbeat_s": None,  # decoder: extend waiting leases this often (None: lease / 3; 0: never)
    "handshake_timeout_s": 5.0,
    "ack_timeout_s": 5.0,
    "transfer_timeout_s": 60.0,
    "unknown_grace_s": 2.0,  # prefiller: wait this long for a hold a decoder asks about
    "fault_done_delay_s": 0.0,  # fault injection (tests): decoder waits this long before Done
    "fault_layer_delay_s": 0.0,  # fault injection (tests): a layer-wise prefiller's layers take this longer
    "secret_file": None,  # the shared side-channel secret's file (else $KVFERRY_KV_SECRET); auth.py
    "allowed_remotes": None,  # decoder: the only prefill side channels it may use ("host" or "host:port")
    "layerwise": False,  # prefiller: a streamed prefill's layers become readable as the forward saves them
    "stream_wait_s": 120.0,  # decoder: wait this long for a streamed prefill to be held
    "progress_thread": True,  # producer: NIXL's UCX progress thread, asleep on UCX's events (agent.py)
}


@dataclass(frozen=True)
class NixlSettings:
    engine_id: str
    side_channel_host: str
    side_channel_port: int
    lease_s: float
    heartbeat_s: float | None
    handshake_timeout_s: float
    ack_timeout_s: float
    transfer_timeout_s: float
    unknown_grace_s: float
    fault_done_delay_s: float
    fault_layer_delay_s: float
    secret_file: str | None
    allowed_remotes: tuple[str, ...] | None
    layerwise: bool
    stream_wait_s: float
    progress_thread: bool

    def allows(self, host: str, port: int) -> bool:
        """Whether the allow-list (if any) lets this decoder connect to host:port."""
        return self.allowed_remotes is None or bool({host, f"{host}:{port}"} & set(self.allowed_remotes))

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> NixlSettings:
        unknown = set(extra) - set(_DEFAULTS)
        if unknown:
            raise ConfigError(f"NixlConnector: unknown kv_connector_extra_config keys {sorted(unknown)}")
        values = {**_DEFAULTS, **extra}
        if not isinstance(values["engine_id"], str) or not values["engine_id"]:
            raise ConfigError("NixlConnector: engine_id must be a non-empty string")
        port = values["side_channel_port"]
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError("NixlConnector: side_channel_port must be an integer in [0, 65535]")
        for key in ("layerwise", "progress_thread"):
            if not isinstance(values[key], bool):
                raise ConfigError(f"NixlConnector: {key} must be true or false")
        for key in ("lease_s", "handshake_timeout_s", "ack_timeout_s", "transfer_timeout_s", "stream_wait_s"):
            if not isinstance(values[key], int | float) or values[key] <= 0:
                raise ConfigError(f"NixlConnector: {key} must be a positive number")
        if values["secret_file"] is not None and not isinstance(values["secret_file"], str):
            raise ConfigError("NixlConnector: secret_file must be a path (a string)")
        values["allowed_remotes"] = _allow_list(values["allowed_remotes"])
        return cls(**values)


def _allow_list(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError('NixlConnector: allowed_remotes must be a list of "host" or "host:port" strings')
    return tuple(value)
