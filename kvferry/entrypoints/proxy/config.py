"""ProxyConfig: where the instances are and how the proxy talks to them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvferry.entrypoints.edge_options import EdgeLimits
from kvferry.errors import ConfigError

logger = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_loaded")
DEFAULT_READ_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    policy: str = "round_robin"
    api_key: str | None = None
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    connect_timeout_s: float = 5.0
    # Longest silence of an instance on any leg (a whole non-streamed answer, or between
    # two stream events) before the client gets a 504; None: no limit.
    read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S
    max_connections: int = 1024
    # Idle pooled connections are dropped before the instances' own keep-alive limit (uvicorn:
    # 5 s), so the proxy seldom sends on a connection the instance is closing.
    keepalive_expiry_s: float = 2.0
    early_first_token: bool = True  # stream the prefill's token before the decoder answers
    limits: EdgeLimits = field(default_factory=EdgeLimits)
    metrics_public: bool = False  # /metrics and /openapi.json without the API key
    proxy_secret: str | None = None  # sent to the instances: kv_transfer_params and releases need it

    def __repr__(self) -> str:  # never print the secrets
        shown = {
            "api_key": "set" if self.api_key else None,
            "proxy_secret": "set" if self.proxy_secret else None,
        }
        fields = {**self.__dict__, **shown}
        return "ProxyConfig(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ConfigError("the proxy needs at least one prefill and one decode URL")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, not {self.policy!r}")
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0:
            raise ConfigError("health check interval and timeout must be positive")
        if self.read_timeout_s is not None and self.read_timeout_s <= 0:
            raise ConfigError("the read timeout must be positive")
        for url in self.prefill_urls + self.decode_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"instance URL must start with http:// or https://: {url!r}")


def normalize_url(url: str) -> str:
    """An instance base URL without a trailing slash or /v1 suffix."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")
