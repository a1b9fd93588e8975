"""ZMQ plumbing of the side channel: a ROUTER server and DEALER clients with timeouts.

Both are non-blocking and owned by one thread: the owner calls `poll` (or polls the shared
zmq.Poller itself) and reads results off `Pending` objects. Every connection proves the
shared secret first (auth.py, gate.py): the server hands only authenticated messages to its
owner, and a client queues its messages until its connection is authenticated. A client
socket makes one TCP connection attempt (no ZMQ reconnects): a peer that is gone, or
never spoke the protocol, fails the requests sent to it and is connected afresh next time.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import overload

import msgspec
import zmq

from kvferry.connector.nixl.auth import PeerAuth, Proof, new_nonce
from kvferry.connector.nixl.gate import Gate
from kvferry.connector.nixl.protocol import (
    Auth,
    Challenge,
    ClientMessage,
    Codec,
    Hello,
    Refused,
    ServerMessage,
)

logger = logging.getLogger(__name__)

Address = tuple[str, int]
MAX_MESSAGE_BYTES = 64 << 20  # a request larger than this closes its connection


@dataclass
class Pending:
    """A request waiting for its reply."""

    address: Address
    deadline: float  # monotonic
    reply: ServerMessage | None = None
    error: str | None = None
    peer: str | None = None  # the authenticated engine id of whoever replied

    @property
    def done(self) -> bool:
        return self.reply is not None or self.error is not None


@dataclass(frozen=True)
class Inbound:
    """An authenticated request: who sent it (connection, engine id) and what."""

    identity: bytes
    message: ClientMessage
    peer: str


class Server:
    """A ROUTER socket; `receive` answers authentication itself and returns the rest."""

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int, poller: zmq.Poller, auth: PeerAuth
    ):
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.codec = Codec()
        self.gate = Gate(auth)
        poller.register(self.socket, zmq.POLLIN)

    def receive(self) -> list[Inbound]:
        """Every authenticated request waiting on the socket."""
        out: list[Inbound] = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) not in (2, 3):
                self.gate.refuse(f"malformed request ({len(frames)} frames)")
                continue
            message = self.codec.decode_client(frames[-1])
            if message is None:
                self.gate.refuse("undecodable request")
                continue
            token = frames[1] if len(frames) == 3 else b""
            inbound = self._admit(frames[0], token, message)
            if inbound is not None:
                out.append(inbound)

    def _admit(self, identity: bytes, token: bytes, message: ClientMessage) -> Inbound | None:
        if isinstance(message, Hello):
            self.reply(identity, self.gate.hello(identity, message))
        elif isinstance(message, Auth):
            if not self.gate.authenticate(identity, message):
                self.reply(identity, Refused(message.seq, "wrong proof of the shared secret"))
        else:
            session = self.gate.admit(identity, token)
            if session is not None:
                return Inbound(identity, message, session.engine_id)
            self.reply(identity, Refused(message.seq, "not authenticated: prove the shared secret first"))
        return None

    def reply(self, identity: bytes, message: msgspec.Struct) -> None:
        try:
            self.socket.send_multipart([identity, self.codec.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("side channel: reply dropped: %s", exc)

    def close(self) -> None:
        self.socket.close(linger=0)


@dataclass
class Link:
    """One client connection: authenticating until it has a session token."""

    socket: zmq.Socket[bytes]
    nonce: bytes
    hello_seq: int
    deadline: float  # monotonic: authenticated by then, or failed
    token: bytes | None = None
    peer: str | None = None  # the remote engine id, proven with the secret
    waiting: list[bytes] = field(default_factory=list)  # encoded requests for after Auth


def _where(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


class Clients:
    """DEALER sockets to remote side channels, one per address; requests time out."""

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], poller: zmq.Poller, auth: PeerAuth, auth_timeout_s: float
    ):
        self.ctx = ctx
        self.poller = poller
        self.auth = auth
        self.auth_timeout_s = auth_timeout_s
        self.codec = Codec()
        self.links: dict[Address, Link] = {}
        self.pending: dict[int, Pending] = {}
        self.num_connects = 0
        self._seq = itertools.count(1)

    def _link(self, address: Address) -> Link:
        link = self.links.get(address)
        if link is not None:
            return link
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one connection attempt; see the module doc
        try:
            sock.connect(f"tcp://{address[0]}:{address[1]}")
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self.num_connects += 1
        self.poller.register(sock, zmq.POLLIN)
        link = Link(sock, new_nonce(), self.next_seq(), time.monotonic() + self.auth_timeout_s)
        self.links[address] = link
        self._put(link, b"", self.codec.encode(Hello(link.hello_seq, link.nonce)))
        return link

    @staticmethod
    def _put(link: Link, token: bytes, payload: bytes) -> None:
        link.socket.send_multipart([token, payload], zmq.NOBLOCK)

    def next_seq(self) -> int:
        return next(self._seq)

    @overload
    def send(self, address: Address, message: ClientMessage, timeout_s: float) -> Pending: ...
    @overload
    def send(self, address: Address, message: ClientMessage, timeout_s: None) -> None: ...
    @overload
    def send(self, address: Address, message: ClientMessage, timeout_s: float | None) -> Pending | None: ...

    def send(self, address: Address, message: ClientMessage, timeout_s: float | None) -> Pending | None:
        """Send a request; with a timeout, the returned Pending gets the reply or an error."""
        pending = None
        if timeout_s is not None:
            pending = Pending(address, time.monotonic() + timeout_s)
            self.pending[message.seq] = pending
        payload = self.codec.encode(message)
        try:
            self._deliver(address, payload)
        except zmq.ZMQError:
            self._drop(address)  # the peer went away (or restarted): one fresh connection
            try:
                self._deliver(address, payload)
            except zmq.ZMQError as exc:
                self._fail(address, f"cannot send to {_where(address)}: {exc}")
        return pending

    def _deliver(self, address: Address, payload: bytes) -> None:
        link = self._link(address)
        if link.token is None:
            link.waiting.append(payload)
        else:
            self._put(link, link.token, payload)

    def receive(self) -> None:
        """Take every reply waiting on any socket; fail requests past their deadline."""
        for address, link in list(self.links.items()):
            self._receive(address, link)
        now = time.monotonic()
        for address, link in list(self.links.items()):
            if link.token is None and link.deadline <= now:
                self._fail(address, f"no authenticated answer from the side channel at {_where(address)}")
        # A request past its deadline fails; its connection stays: what the owner sends next
        # (a Release after giving up) must reach the peer after what it sent before (a
        # Check), in order, should the peer only be slow. A dead peer fails the next send.
        for seq in [s for s, p in self.pending.items() if p.deadline <= now]:
            pending = self.pending.pop(seq)
            pending.error = f"no answer from {_where(pending.address)}"

    def _receive(self, address: Address, link: Link) -> None:
        while self.links.get(address) is link:
            try:
                payload = link.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = self.codec.decode_server(payload)
            if isinstance(reply, Challenge):
                self._answer(address, link, reply)
            elif isinstance(reply, Refused):
                self._fail(address, f"the side channel at {_where(address)} refused: {reply.reason}")
            elif reply is not None:
                pending = self.pending.pop(reply.seq, None)
                if pending is not None:
                    pending.reply, pending.peer = reply, link.peer

    def _answer(self, address: Address, link: Link, challenge: Challenge) -> None:
        """The server proved the secret: prove it back, then send what waited."""
        if link.token is not None or challenge.seq != link.hello_seq:
            return
        if not self.auth.verify(
            Proof.SERVER, link.nonce, challenge.nonce, challenge.engine_id, challenge.proof
        ):
            self._fail(
                address,
                f"the side channel at {_where(address)} did not prove the shared secret "
                "(every prefill and decode instance needs the same $KVFERRY_KV_SECRET or secret file)",
            )
            return
        engine_id = self.auth.engine_id
        proof = self.auth.mac(Proof.CLIENT, link.nonce, challenge.nonce, engine_id)
        link.token = self.auth.mac(Proof.SESSION, link.nonce, challenge.nonce, engine_id)
        link.peer = challenge.engine_id
        try:
            self._put(link, b"", self.codec.encode(Auth(self.next_seq(), engine_id, proof)))
            for payload in link.waiting:
                self._put(link, link.token, payload)
        except zmq.ZMQError as exc:
            self._fail(address, f"cannot send to {_where(address)}: {exc}")
        link.waiting = []

    def _fail(self, address: Address, why: str) -> None:
        """Fail every request to `address` and forget its connection."""
        for seq in [s for s, p in self.pending.items() if p.address == address]:
            self.pending.pop(seq).error = why
        self._drop(address)

    def _drop(self, address: Address) -> None:
        link = self.links.pop(address, None)
        if link is not None:
            self.poller.unregister(link.socket)
            link.socket.close(linger=0)

    def close(self) -> None:
        for address in list(self.links):
            self._drop(address)
        for pending in self.pending.values():
            pending.error = "side channel closed"
        self.pending.clear()
