"""Server side of side-channel authentication: which connections hold a session.

A connection is a ROUTER identity. Hello gets a challenge (the server's nonce and proof;
no engine id), and the connection's keys are derived then (auth.py). Its first sealed
message must open with them and be Auth: that proves the secret and opens the session,
answered with a sealed Welcome. From then on every message must be sealed with the
session's keys and numbered above the last one (sealing.py); one that does not open ends
the session. Anything else is refused and counted. Challenges and sessions are bounded
(oldest forgotten first): a flood of Hellos costs memory once, and a forgotten legitimate
client authenticates again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TypeVar

from kvferry.connector.nixl.auth import PeerAuth, SessionKeys, new_nonce
from kvferry.connector.nixl.protocol import (
    Auth,
    Challenge,
    ClientMessage,
    Codec,
    Hello,
    Sealed,
    ServerMessage,
    Welcome,
)
from kvferry.connector.nixl.sealing import Opener, Sealer, SealError

logger = logging.getLogger(__name__)

V = TypeVar("V")

MAX_CHALLENGES = 1024
MAX_SESSIONS = 4096
LOGGED_REFUSALS = 20  # then one log line per 1000 refusals


@dataclass
class Session:
    engine_id: str  # the authenticated peer engine
    opener: Opener  # its messages to us
    sealer: Sealer  # ours to it


@dataclass(frozen=True)
class Opened:
    """A sealed request that opened in an authenticated session."""

    session: Session
    message: ClientMessage


@dataclass
class GateCounts:
    refused: int = 0  # messages without a valid session (or that did not open in it)
    failed: int = 0  # first sealed messages that did not prove the secret (or came without a challenge)


@dataclass
class Gate:
    auth: PeerAuth
    codec: Codec = field(default_factory=Codec)
    challenges: OrderedDict[bytes, SessionKeys] = field(default_factory=OrderedDict)
    sessions: OrderedDict[bytes, Session] = field(default_factory=OrderedDict)
    counts: GateCounts = field(default_factory=GateCounts)

    def hello(self, identity: bytes, message: Hello) -> Challenge:
        server_nonce = new_nonce()
        keys = self.auth.session(bytes(message.nonce), server_nonce)
        self.sessions.pop(identity, None)  # a new Hello starts over
        _put(self.challenges, identity, keys, MAX_CHALLENGES)
        return Challenge(message.seq, server_nonce, keys.server_proof)

    def open(self, identity: bytes, sealed: Sealed) -> Opened | Welcome | None:
        """The request inside `sealed`; a Welcome to send when it opened a session; None:
        refused (counted, and the connection's session, if any, ended)."""
        session = self.sessions.get(identity)
        if session is None:
            return self._authenticate(identity, sealed)
        try:
            message = self.codec.client_message(session.opener.open(sealed.counter, bytes(sealed.box)))
        except SealError as exc:
            self.sessions.pop(identity, None)
            self.refuse(f"sealed message that does not open in its session ({exc}); session ended")
            return None
        if message is None or isinstance(message, Auth):
            self.refuse("undecodable or repeated Auth message in a session")
            return None
        self.sessions.move_to_end(identity)
        return Opened(session, message)

    def _authenticate(self, identity: bytes, sealed: Sealed) -> Welcome | None:
        keys = self.challenges.pop(identity, None)
        opened = None if keys is None else self._open_auth(keys, sealed)
        if keys is None or opened is None:
            self.counts.failed += 1
            logger.warning("side channel: a peer failed to prove the shared secret")
            return None
        auth, opener = opened
        _put(self.sessions, identity, Session(auth.engine_id, opener, Sealer(keys.to_client)), MAX_SESSIONS)
        return Welcome(auth.seq, self.auth.engine_id)

    def _open_auth(self, keys: SessionKeys, sealed: Sealed) -> tuple[Auth, Opener] | None:
        """The Auth a connection's first sealed message holds (and the connection's opener),
        or None: it was not sealed with the keys only the secret gives."""
        opener = Opener(keys.to_server)
        try:
            message = self.codec.client_message(opener.open(sealed.counter, bytes(sealed.box)))
        except SealError:
            return None
        return (message, opener) if isinstance(message, Auth) else None

    def seal(self, identity: bytes, message: ServerMessage) -> Sealed | None:
        """`message` sealed for the connection's session; None when it has none (any more)."""
        session = self.sessions.get(identity)
        if session is None:
            return None
        counter, box = session.sealer.seal(self.codec.encode(message))
        return Sealed(counter, box)

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
