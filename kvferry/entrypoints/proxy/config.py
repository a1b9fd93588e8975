"""ProxyConfig: where the instances are and how the proxy talks to them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvferry.entrypoints.edge_options import EdgeLimits
from kvferry.errors import ConfigError

logger = logging.getLogger(__name__)

POLICIES = ("round_robin", "least_loaded", "prefix")
DEFAULT_BLOCK_SIZE = 16  # the engine's (kvferry.config.CacheConfig)
DEFAULT_LOAD_TOKENS = 512  # --prefix-load-tokens (kvferry/entrypoints/proxy/prefix_route.py)
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
    # --policy prefix: the instances' model (its tokenizer and chat template), their block
    # size, and where each instance publishes KV events (ENDPOINT[,REPLAY], in URL order;
    # none for a role: its instances are chosen by load alone).
    tokenizer: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    prefill_kv_events: tuple[str, ...] = ()
    decode_kv_events: tuple[str, ...] = ()
    prefix_load_tokens: int = DEFAULT_LOAD_TOKENS
    # Per-request disaggregation: a leg whose prompt has at most this many tokens not cached
    # on the decoder holding most of it is prefilled by the decoder itself (0: never).
    local_prefill_tokens: int = 0
    # ... and, with this, a leg that would wait behind busy prefillers while a decoder has
    # nothing in flight is prefilled by that decoder (any policy).
    idle_decoder_prefills: bool = False
    # ... and, with this, such a leg is answered whole by a prefiller with fewer requests in
    # flight than every decoder.
    local_on_prefillers: bool = False

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
        self._check_prefix_options()
        for url in self.prefill_urls + self.decode_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"instance URL must start with http:// or https://: {url!r}")

    def _check_prefix_options(self) -> None:
        given = bool(self.prefill_kv_events or self.decode_kv_events)
        if self.local_prefill_tokens < 0:
            raise ConfigError("--local-prefill-tokens must not be negative")
        if self.local_on_prefillers and not (self.local_prefill_tokens or self.idle_decoder_prefills):
            raise ConfigError(
                "--local-on-prefillers places the requests sent local by --local-prefill-tokens "
                "or --idle-decoder-prefills: give one of them"
            )
        if self.policy != "prefix":
            if given or self.tokenizer is not None or self.local_prefill_tokens:
                raise ConfigError(
                    "--tokenizer, --*-kv-events and --local-prefill-tokens are options of --policy prefix"
                )
            return
        if self.tokenizer is None:
            raise ConfigError("--policy prefix needs --tokenizer (the instances' model)")
        if self.block_size < 1 or self.prefix_load_tokens < 0:
            raise ConfigError("--block-size must be positive and --prefix-load-tokens not negative")
        for role, urls, events in (
            ("prefill", self.prefill_urls, self.prefill_kv_events),
            ("decode", self.decode_urls, self.decode_kv_events),
        ):
            if events and len(events) != len(urls):
                raise ConfigError(f"--{role}-kv-events needs one endpoint per --{role} URL ({len(urls)})")
        if not given:
            logger.warning("--policy prefix without --prefill-kv-events: instances are chosen by load alone")


def normalize_url(url: str) -> str:
    """An instance base URL without a trailing slash or /v1 suffix."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")
