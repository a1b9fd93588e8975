"""`kvferry serve` and the NixlConnector's side channel: where it binds, which secret, and
whether the instance may start at all (docs/security.md).

    side_channel_host  default: the instance's own --host (a wildcard or IPv6 --host keeps
                       127.0.0.1: the side channel's address is also what decoders dial)
    secret             --kv-transfer-secret-file, else $KVFERRY_KV_SECRET
    no secret          a loud warning; with an API key the instance refuses to start (its
                       HTTP API is protected, its KV would not be)
"""

from __future__ import annotations

import dataclasses
import logging

from kvferry.config import EngineConfig
from kvferry.connector.factory import resolve_connector_class
from kvferry.connector.nixl.auth import SECRET_ENV, process_secret
from kvferry.connector.nixl.connector import NixlConnector
from kvferry.errors import ConfigError

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def _uses_side_channel(config: EngineConfig) -> bool:
    transfer = config.kv_transfer
    return transfer.enabled and issubclass(resolve_connector_class(transfer), NixlConnector)


def for_serving(config: EngineConfig, host: str, secret_file: str | None, has_api_key: bool) -> EngineConfig:
    """The engine config of a served instance, its side channel settled (ConfigError: refused)."""
    if not _uses_side_channel(config):
        if secret_file is not None:
            raise ConfigError("--kv-transfer-secret-file needs the NixlConnector (--kv-transfer-config)")
        return config
    extra = dict(config.kv_transfer.kv_connector_extra_config)
    if secret_file is not None:
        extra["secret_file"] = secret_file
    if "side_channel_host" not in extra:
        if host in WILDCARD_HOSTS or ":" in host:  # (IPv6: the side channel speaks IPv4 only)
            logger.warning(
                "--host %r: the KV side channel listens on 127.0.0.1 only; give side_channel_host "
                "in kv_connector_extra_config for decoders on other hosts",
                host,
            )
        else:
            extra["side_channel_host"] = host
    if process_secret(extra.get("secret_file")) is None and has_api_key:
        raise ConfigError(
            "this instance has an API key but its KV side channel would be unauthenticated: "
            f"set ${SECRET_ENV} or --kv-transfer-secret-file (the same secret on every prefill "
            "and decode instance)"
        )
    transfer = dataclasses.replace(config.kv_transfer, kv_connector_extra_config=extra)
    return dataclasses.replace(config, kv_transfer=transfer)
