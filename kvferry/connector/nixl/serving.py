"""A served instance's side channel (`kvferry serve`, through ServedInstance): where it
binds and which secret it uses; and whether the instance may start at all
(docs/security.md). NixlConnector.settle applies this where the config is resolved.

    side_channel_host  default: the instance's own --host (a wildcard or IPv6 --host keeps
                       127.0.0.1: the side channel's address is also what decoders dial)
    secret             --kv-transfer-secret-file, else $KVFERRY_KV_SECRET
    no secret          a loud warning; with an API key the instance refuses to start (its
                       HTTP API is protected, its KV would not be)
"""

from __future__ import annotations

import logging
from typing import Any

from kvferry.connector.base import ServedInstance
from kvferry.connector.nixl.auth import SECRET_ENV
from kvferry.errors import ConfigError

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def served_extra(extra: dict[str, Any], served: ServedInstance) -> dict[str, Any]:
    """The connector's extra config on a served instance: its secret file and side-channel host."""
    extra = dict(extra)
    if served.kv_secret_file is not None:
        extra["secret_file"] = served.kv_secret_file
    if "side_channel_host" not in extra:
        host = served.host
        if host in WILDCARD_HOSTS or ":" in host:  # (IPv6: the side channel speaks IPv4 only)
            logger.warning(
                "--host %r: the KV side channel listens on 127.0.0.1 only; give side_channel_host "
                "in kv_connector_extra_config for decoders on other hosts",
                host,
            )
        else:
            extra["side_channel_host"] = host
    return extra


def refuse_unauthenticated(served: ServedInstance | None) -> None:
    """An instance without a side-channel secret: refused when its HTTP API has a key."""
    if served is not None and served.has_api_key:
        raise ConfigError(
            "this instance has an API key but its KV side channel would be unauthenticated: "
            f"set ${SECRET_ENV} or --kv-transfer-secret-file (the same secret on every prefill "
            "and decode instance)"
        )
