"""ZMQ plumbing of the side channel: a ROUTER server and DEALER clients with timeouts.

Both are non-blocking and owned by one thread: the owner calls `poll` (or polls the shared
zmq.Poller itself) and reads results off `Pending` objects.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import msgspec
import zmq

from kvferry.connector.nixl.protocol import ClientMessage, Codec, ServerMessage

logger = logging.getLogger(__name__)

Address = tuple[str, int]


@dataclass
class Pending:
    """A request waiting for its reply."""

    address: Address
    deadline: float  # monotonic
    reply: ServerMessage | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.reply is not None or self.error is not None


class Server:
    """A ROUTER socket serving requests; `handle(identity, message)` comes from the owner."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, poller: zmq.Poller):
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if port:
            self.socket.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.codec = Codec()
        poller.register(self.socket, zmq.POLLIN)

    def receive(self) -> list[tuple[bytes, ClientMessage]]:
        """Every request waiting on the socket."""
        out = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 2:
                logger.warning("side channel: malformed request (%d frames) dropped", len(frames))
                continue
            message = self.codec.decode_client(frames[1])
            if message is not None:
                out.append((frames[0], message))

    def reply(self, identity: bytes, message: msgspec.Struct) -> None:
        try:
            self.socket.send_multipart([identity, self.codec.encode(message)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("side channel: reply dropped: %s", exc)

    def close(self) -> None:
        self.socket.close(linger=0)


class Clients:
    """DEALER sockets to remote side channels, one per address; requests time out."""

    def __init__(self, ctx: zmq.Context, poller: zmq.Poller):
        self.ctx = ctx
        self.poller = poller
        self.codec = Codec()
        self.sockets: dict[Address, zmq.Socket] = {}
        self.pending: dict[int, Pending] = {}
        self._seq = itertools.count(1)

    def _socket(self, address: Address) -> zmq.Socket:
        sock = self.sockets.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10000)
            sock.connect(f"tcp://{address[0]}:{address[1]}")
            self.poller.register(sock, zmq.POLLIN)
            self.sockets[address] = sock
        return sock

    def next_seq(self) -> int:
        return next(self._seq)

    def send(self, address: Address, message: ClientMessage, timeout_s: float | None) -> Pending | None:
        """Send a request; with a timeout, the returned Pending gets the reply or an error."""
        pending = None
        if timeout_s is not None:
            pending = Pending(address, time.monotonic() + timeout_s)
            self.pending[message.seq] = pending
        try:
            self._socket(address).send(self.codec.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if pending is not None:
                del self.pending[message.seq]
                pending.error = f"cannot send to {address[0]}:{address[1]}: {exc}"
        return pending

    def receive(self) -> None:
        """Take every reply waiting on any socket; fail requests past their deadline."""
        for sock in self.sockets.values():
            while True:
                try:
                    payload = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                reply = self.codec.decode_server(payload)
                pending = self.pending.pop(reply.seq, None) if reply is not None else None
                if pending is not None:
                    pending.reply = reply
        now = time.monotonic()
        silent = set()
        for seq in [s for s, p in self.pending.items() if p.deadline <= now]:
            pending = self.pending.pop(seq)
            pending.error = f"no answer from {pending.address[0]}:{pending.address[1]}"
            silent.add(pending.address)
        for address in silent - {p.address for p in self.pending.values()}:
            self._drop(address)  # queued requests to a silent peer must not linger

    def _drop(self, address: Address) -> None:
        sock = self.sockets.pop(address, None)
        if sock is not None:
            self.poller.unregister(sock)
            sock.close(linger=0)

    def close(self) -> None:
        for address in list(self.sockets):
            self._drop(address)
        for pending in self.pending.values():
            pending.error = "side channel closed"
        self.pending.clear()
