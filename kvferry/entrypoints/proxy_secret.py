"""The proxy's own credential: what lets an instance tell the P/D proxy from its clients.

Every client of a deployment holds the API key, so the API key cannot decide who may send
``kv_transfer_params`` (which make a prefiller keep KV, or a decoder dial a side channel
and read KV) or release a prefill's KV. Those need the proxy secret instead: the proxy
sends it in the ``X-KVFerry-Proxy-Secret`` header of every request to an instance, and
the instance compares it in constant time (docs/security.md).

The secret comes from ``--proxy-secret-file PATH`` (``kvferry serve``, ``kvferry proxy``),
else ``$KVFERRY_PROXY_SECRET``; ``kvferry disagg`` makes a fresh one for the deployment
it starts. Never a command-line value.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvferry.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)

PROXY_SECRET_ENV = "KVFERRY_PROXY_SECRET"
PROXY_SECRET_HEADER = "x-kvferry-proxy-secret"
MIN_SECRET_CHARS = 16


class ProxyOnlyError(InvalidRequestError):
    """A request only the deployment's proxy may make, without the proxy's credential."""

    status_code = 403
    error_type = "permission_error"


def load_proxy_secret(path: str | None, environ: Mapping[str, str]) -> str | None:
    """The proxy secret: the file when one is given, else $KVFERRY_PROXY_SECRET, else None."""
    if path:
        try:
            value = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the proxy secret file {path}: {exc}") from exc
        where = path
    else:
        value, where = environ.get(PROXY_SECRET_ENV, "").strip(), f"${PROXY_SECRET_ENV}"
        if not value:
            return None
    if len(value) < MIN_SECRET_CHARS:
        raise ConfigError(f"the proxy secret in {where} is shorter than {MIN_SECRET_CHARS} characters")
    return value


def process_proxy_secret(path: str | None) -> str | None:
    """`load_proxy_secret` from this process's environment."""
    return load_proxy_secret(path, os.environ)


def for_instance(path: str | None, kv_connector: bool, has_api_key: bool) -> str | None:
    """A served instance's proxy secret (ConfigError: it may not start). An instance with a
    KV connector and an API key needs one: else every API-key holder could hand it
    kv_transfer_params."""
    secret = process_proxy_secret(path)
    if secret is None and kv_connector:
        if has_api_key:
            raise ConfigError(
                "this instance has an API key and a KV connector but no proxy secret: every client "
                f"could send kv_transfer_params; set ${PROXY_SECRET_ENV} or --proxy-secret-file "
                "(the same on the proxy and every instance)"
            )
        logger.warning(
            "no proxy secret ($%s or --proxy-secret-file): any client may send kv_transfer_params "
            "and release KV",
            PROXY_SECRET_ENV,
        )
    return secret


@dataclass(frozen=True)
class ProxyCredential:
    """An instance's check of the proxy's credential. Without a secret every caller passes
    (an open deployment; `kvferry serve` refuses that combined with an API key and a KV
    connector)."""

    secret: str | None = None

    def __repr__(self) -> str:  # never print the secret
        return f"ProxyCredential({'set' if self.secret else 'none'})"

    def proven_by(self, headers: Mapping[str, str]) -> bool:
        if self.secret is None:
            return True
        given = headers.get(PROXY_SECRET_HEADER, "")
        return hmac.compare_digest(given.encode(), self.secret.encode())

    def require(self, headers: Mapping[str, str], what: str, param: str | None = None) -> None:
        """Raise ProxyOnlyError (HTTP 403) unless the headers carry the proxy's credential."""
        if not self.proven_by(headers):
            raise ProxyOnlyError(
                f"{what} is accepted from the deployment's proxy only (its credential, not the API key)",
                param,
            )


def proxy_headers(secret: str | None) -> dict[str, str]:
    """What the proxy adds to each request to an instance."""
    return {PROXY_SECRET_HEADER: secret} if secret else {}
