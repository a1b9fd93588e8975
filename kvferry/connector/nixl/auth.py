"""Side-channel authentication: a shared secret, proven per connection, keying the session.

Every connection to a prefiller's side channel starts with (docs/security.md):

    client -> Hello(nonce_c)
    server -> Challenge(nonce_s, server_proof)            names no engine
    client -> Sealed(Auth(client engine id))               (checks server_proof first)
    server -> Sealed(Welcome(server engine id))

Both sides derive the connection's keys from the secret and both nonces (HMAC-SHA256 as
HKDF's extract and expand): a proof the server sends, and for each direction an
encryption key and a MAC key (sealing.py). Sealing Auth needs the client's key, so it
proves the secret; every later message is sealed the same way. A relay that forwards the
bytes of a connection sees nonces and a proof, never a key: it can read nothing and
inject nothing.

The secret comes from the environment (``KVFERRY_KV_SECRET``) or a file (the extra config's
``secret_file``, set by ``kvferry serve --kv-transfer-secret-file``), never from the
command line. Without one the keys derive from an empty secret: anyone can compute them,
and the engine says so loudly at start-up.
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
EXTRACT_LABEL = b"kvferry-side-channel/v2"


class KeyUse(Enum):
    """What a derived key is for: domain-separated, so one cannot stand for another."""

    SERVER_PROOF = b"server-proof"
    TO_SERVER_ENC = b"client-to-server/encrypt"
    TO_SERVER_MAC = b"client-to-server/mac"
    TO_CLIENT_ENC = b"server-to-client/encrypt"
    TO_CLIENT_MAC = b"server-to-client/mac"


@dataclass(frozen=True)
class DirectionKeys:
    """The keys of one direction of one connection."""

    encrypt: bytes
    mac: bytes

    def __repr__(self) -> str:  # never print a key
        return "DirectionKeys(...)"


@dataclass(frozen=True)
class SessionKeys:
    """One connection's keys, from the secret and both nonces."""

    server_proof: bytes
    to_server: DirectionKeys
    to_client: DirectionKeys

    def __repr__(self) -> str:
        return "SessionKeys(...)"


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
    """This engine's side of the handshake: the shared secret and its own engine id."""

    secret: bytes = b""
    engine_id: str = ""

    def __repr__(self) -> str:  # never print the secret
        return f"PeerAuth(engine_id={self.engine_id!r}, secret={'set' if self.secret else 'none'})"

    @property
    def enabled(self) -> bool:
        return bool(self.secret)

    def session(self, client_nonce: bytes, server_nonce: bytes) -> SessionKeys:
        """The keys of the connection that exchanged these nonces, HKDF-style with SHA-256:
        a pseudorandom key HMAC(secret, label | nonces) (the secret keys it: the nonces are
        public), then one HMAC block of it per use."""
        salted = b"".join(_field(f) for f in (EXTRACT_LABEL, client_nonce, server_nonce))
        prk = hmac.new(self.secret, salted, hashlib.sha256).digest()

        def expand(use: KeyUse) -> bytes:
            return hmac.new(prk, use.value + b"\x01", hashlib.sha256).digest()

        return SessionKeys(
            server_proof=expand(KeyUse.SERVER_PROOF),
            to_server=DirectionKeys(expand(KeyUse.TO_SERVER_ENC), expand(KeyUse.TO_SERVER_MAC)),
            to_client=DirectionKeys(expand(KeyUse.TO_CLIENT_ENC), expand(KeyUse.TO_CLIENT_MAC)),
        )


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
