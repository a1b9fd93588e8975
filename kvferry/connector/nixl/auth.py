"""Side-channel authentication: a shared secret, proven by HMAC challenge-response.

Every connection to a prefiller's side channel starts with a mutual proof of the secret
(docs/security.md):

    client -> Hello(client nonce)
    server -> Challenge(server nonce, server engine id, HMAC(secret, "server" | nonces | id))
    client -> Auth(client engine id, HMAC(secret, "client" | nonces | id))   (checks the proof first)

Both sides then know the session token HMAC(secret, "session" | nonces | client id); the
client sends it with every later message on that connection, and the server answers only
messages whose connection proved the secret and whose token matches. Nothing else (engine
info, lease answers, releases) is answered before that.

The secret comes from the environment (``KVFERRY_KV_SECRET``) or a file (the extra config's
``secret_file``, set by ``kvferry serve --kv-transfer-secret-file``), never from the
command line. Without one the proofs use an empty key: anyone can answer them, and the
engine says so loudly at start-up.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from kvferry.errors import ConfigError

logger = logging.getLogger(__name__)

SECRET_ENV = "KVFERRY_KV_SECRET"
NONCE_BYTES = 32
MIN_SECRET_BYTES = 16


class Proof(Enum):
    """What a MAC proves: the roles are domain-separated, so one cannot stand for another."""

    SERVER = b"kvferry-side-channel/server"
    CLIENT = b"kvferry-side-channel/client"
    SESSION = b"kvferry-side-channel/session"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def read_secret_file(path: str) -> bytes:
    try:
        data = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the KV side-channel secret file {path}: {exc}") from exc
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError(f"the KV side-channel secret in {path} is shorter than {MIN_SECRET_BYTES} bytes")
    return data


def load_secret(secret_file: str | None, environ: Mapping[str, str]) -> bytes | None:
    """The shared secret: the file when one is given, else $KVFERRY_KV_SECRET, else None."""
    if secret_file:
        return read_secret_file(secret_file)
    value = environ.get(SECRET_ENV, "").strip().encode()
    if not value:
        return None
    if len(value) < MIN_SECRET_BYTES:
        raise ConfigError(f"${SECRET_ENV} is shorter than {MIN_SECRET_BYTES} bytes")
    return value


def process_secret(secret_file: str | None) -> bytes | None:
    """`load_secret` from this process's environment."""
    return load_secret(secret_file, os.environ)


@dataclass(frozen=True)
class PeerAuth:
    """This engine's side of the proofs: the shared secret and its own engine id."""

    secret: bytes = b""
    engine_id: str = ""

    def __repr__(self) -> str:  # never print the secret
        return f"PeerAuth(engine_id={self.engine_id!r}, secret={'set' if self.secret else 'none'})"

    @property
    def enabled(self) -> bool:
        return bool(self.secret)

    def mac(self, proof: Proof, client_nonce: bytes, server_nonce: bytes, engine_id: str) -> bytes:
        message = b"".join(_field(f) for f in (proof.value, client_nonce, server_nonce, engine_id.encode()))
        return hmac.new(self.secret, message, hashlib.sha256).digest()

    def verify(
        self, proof: Proof, client_nonce: bytes, server_nonce: bytes, engine_id: str, mac: bytes
    ) -> bool:
        return hmac.compare_digest(self.mac(proof, client_nonce, server_nonce, engine_id), mac)


def warn_without_secret(engine_id: str) -> None:
    logger.warning(
        "\n%s\nKV SIDE CHANNEL UNAUTHENTICATED (engine %s): no shared secret ($%s or "
        "--kv-transfer-secret-file). Anyone who reaches the side-channel port can read the KV "
        "cache (other users' prompts) and release leases. Set the same secret on every "
        "prefill and decode instance; `kvferry disagg` does it for the instances it starts.\n%s",
        "!" * 80,
        engine_id,
        SECRET_ENV,
        "!" * 80,
    )
