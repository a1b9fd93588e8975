"""ZMQ plumbing of the side channel: a ROUTER server and DEALER clients with timeouts.

Both are non-blocking and owned by one thread: the owner calls `poll` (or polls the shared
zmq.Poller itself) and reads results off `Pending` objects. Every connection proves the
shared secret first (auth.py, gate.py): the server hands only authenticated messages to its
owner, and a client queues its messages until its connection is authenticated. After
the clear Hello and Challenge every message is sealed (sealing.py), one frame each. A client
socket makes one TCP connection attempt (no ZMQ reconnects): a peer that is gone, or
never spoke the protocol, fails the requests sent to it and is connected afresh next time.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import overload

import zmq

from kvferry.connector.nixl.auth import PeerAuth, new_nonce
from kvferry.connector.nixl.gate import Gate, Opened
from kvferry.connector.nixl.protocol import (
    Auth,
    Challenge,
    ClientFrame,
    ClientMessage,
    Codec,
    Hello,
    Refused,
    Sealed,
    ServerMessage,
    Welcome,
)
from kvferry.connector.nixl.sealing import Opener, Sealer, SealError

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
            frame = self.codec.client_frame(frames[-1]) if len(frames) == 2 else None
            if frame is None:
                self.gate.refuse(f"malformed or undecodable request ({len(frames)} frames)")
                self._send(frames[0], Refused(0, "not a side-channel request (one frame, Hello or sealed)"))
                continue
            identity = frames[0]
            inbound = self._admit(identity, frame)
            if inbound is not None:
                out.append(inbound)

    def _admit(self, identity: bytes, frame: ClientFrame) -> Inbound | None:
        if isinstance(frame, Hello):
            self._send(identity, self.gate.hello(identity, frame))
            return None
        if not isinstance(frame, Sealed):  # a request in the clear: an old or foreign client
            self.gate.refuse("request that was not sealed in a session")
            self._send(identity, Refused(frame.seq, "not authenticated: prove the shared secret first"))
            return None
        opened = self.gate.open(identity, frame)
        if isinstance(opened, Opened):
            return Inbound(identity, opened.message, opened.session.engine_id)
        if isinstance(opened, Welcome):
            self.reply(identity, opened)
        else:
            self._send(identity, Refused(0, "not authenticated: prove the shared secret first"))
        return None

    def reply(self, identity: bytes, message: ServerMessage) -> None:
        """Answer an authenticated request: sealed for its connection's session."""
        sealed = self.gate.seal(identity, message)
        if sealed is None:
            logger.warning("side channel: reply dropped: its connection's session ended")
            return
        self._send(identity, sealed)

    def _send(self, identity: bytes, frame: Challenge | Refused | Sealed) -> None:
        try:
            self.socket.send_multipart([identity, self.codec.encode(frame)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("side channel: reply dropped: %s", exc)

    def close(self) -> None:
        self.socket.close(linger=0)


@dataclass
class Link:
    """One client connection: authenticating until it has its session's keys."""

    socket: zmq.Socket[bytes]
    nonce: bytes
    hello_seq: int
    deadline: float  # monotonic: authenticated by then, or failed
    sealer: Sealer | None = None  # ours to the server, once it proved the secret
    opener: Opener | None = None  # its messages to us
    peer: str | None = None  # the remote engine id, from its sealed Welcome
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
        link.socket.send(self.codec.encode(Hello(link.hello_seq, link.nonce)), zmq.NOBLOCK)
        return link

    def _put(self, link: Link, sealer: Sealer, payload: bytes) -> None:
        counter, box = sealer.seal(payload)
        link.socket.send(self.codec.encode(Sealed(counter, box)), zmq.NOBLOCK)

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
        if link.sealer is None:
            link.waiting.append(payload)
        else:
            self._put(link, link.sealer, payload)

    def receive(self) -> None:
        """Take every reply waiting on any socket; fail requests past their deadline."""
        for address, link in list(self.links.items()):
            self._receive(address, link)
        now = time.monotonic()
        for address, link in list(self.links.items()):
            if link.peer is None and link.deadline <= now:
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
            frame = self.codec.server_frame(payload)
            if isinstance(frame, Challenge):
                self._answer(address, link, frame)
            elif isinstance(frame, Refused):
                self._fail(address, f"the side channel at {_where(address)} refused: {frame.reason}")
            elif isinstance(frame, Sealed):
                self._open(address, link, frame)

    def _open(self, address: Address, link: Link, sealed: Sealed) -> None:
        """A sealed reply: it must open with the session's keys, in order, or the
        connection is failed (someone between us and the server made it up)."""
        if link.opener is None:
            self._fail(address, f"the side channel at {_where(address)} sent a sealed reply before its proof")
            return
        try:
            reply = self.codec.server_message(link.opener.open(sealed.counter, bytes(sealed.box)))
        except SealError as exc:
            self._fail(address, f"a reply from the side channel at {_where(address)} did not open: {exc}")
            return
        if isinstance(reply, Welcome):
            link.peer = reply.engine_id
        elif reply is not None:
            pending = self.pending.pop(reply.seq, None)
            if pending is not None:
                pending.reply, pending.peer = reply, link.peer

    def _answer(self, address: Address, link: Link, challenge: Challenge) -> None:
        """The server proved the secret: seal Auth with the session's keys (which proves it
        back), then what waited."""
        if link.sealer is not None or challenge.seq != link.hello_seq:
            return
        keys = self.auth.session(link.nonce, bytes(challenge.nonce))
        if not hmac.compare_digest(keys.server_proof, bytes(challenge.proof)):
            self._fail(
                address,
                f"the side channel at {_where(address)} did not prove the shared secret "
                "(every prefill and decode instance needs the same $KVFERRY_KV_SECRET or secret file)",
            )
            return
        link.sealer, link.opener = Sealer(keys.to_server), Opener(keys.to_client)
        try:
            self._put(link, link.sealer, self.codec.encode(Auth(self.next_seq(), self.auth.engine_id)))
            for payload in link.waiting:
                self._put(link, link.sealer, payload)
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
