"""Server side of side-channel authentication: which connections proved the secret.

A connection is a ROUTER identity. It gets a challenge on Hello, a session when its Auth
proves the secret, and every later message must carry that session's token. Anything else
is refused and counted. Challenges and sessions are bounded (oldest forgotten first): a
flood of Hellos costs memory once, and a forgotten legitimate client authenticates again.
"""

from __future__ import annotations

import hmac
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

from kvferry.connector.nixl.auth import PeerAuth, Proof, new_nonce
from kvferry.connector.nixl.protocol import Auth, Challenge, Hello

logger = logging.getLogger(__name__)

V = TypeVar("V")

MAX_CHALLENGES = 1024
MAX_SESSIONS = 4096
LOGGED_REFUSALS = 20  # then one log line per 1000 refusals


@dataclass(frozen=True)
class Session:
    engine_id: str  # the authenticated peer engine
    token: bytes


@dataclass(frozen=True)
class _Challenge:
    client_nonce: bytes
    server_nonce: bytes


@dataclass
class GateCounts:
    refused: int = 0  # messages without a valid session
    failed: int = 0  # Auth messages whose proof was wrong (or came without a challenge)


class Gate:
    def __init__(self, auth: PeerAuth):
        self.auth = auth
        self.challenges: OrderedDict[bytes, _Challenge] = OrderedDict()
        self.sessions: OrderedDict[bytes, Session] = OrderedDict()
        self.counts = GateCounts()

    def hello(self, identity: bytes, message: Hello) -> Challenge:
        challenge = _Challenge(bytes(message.nonce), new_nonce())
        self.sessions.pop(identity, None)  # a new Hello starts over
        _put(self.challenges, identity, challenge, MAX_CHALLENGES)
        proof = self.auth.mac(
            Proof.SERVER, challenge.client_nonce, challenge.server_nonce, self.auth.engine_id
        )
        return Challenge(message.seq, challenge.server_nonce, self.auth.engine_id, proof)

    def authenticate(self, identity: bytes, message: Auth) -> bool:
        challenge = self.challenges.pop(identity, None)
        if challenge is None or not self.auth.verify(
            Proof.CLIENT, challenge.client_nonce, challenge.server_nonce, message.engine_id, message.proof
        ):
            self.counts.failed += 1
            logger.warning(
                "side channel: a peer claiming engine %r failed to prove the shared secret",
                message.engine_id[:64],
            )
            return False
        token = self.auth.mac(
            Proof.SESSION, challenge.client_nonce, challenge.server_nonce, message.engine_id
        )
        _put(self.sessions, identity, Session(message.engine_id, token), MAX_SESSIONS)
        return True

    def admit(self, identity: bytes, token: bytes) -> Session | None:
        """The session a message belongs to, or None (refused, counted)."""
        session = self.sessions.get(identity)
        if session is not None and hmac.compare_digest(session.token, token):
            self.sessions.move_to_end(identity)
            return session
        self.refuse("message without an authenticated session")
        return None

    def refuse(self, why: str) -> None:
        self.counts.refused += 1
        n = self.counts.refused
        if n <= LOGGED_REFUSALS or n % 1000 == 0:
            logger.warning("side channel: refused a %s (%d refused so far)", why, n)


def _put(table: OrderedDict[bytes, V], key: bytes, value: V, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)
