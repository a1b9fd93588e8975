"""Prefill side of a worker's side channel: handshakes, and the lease protocol.

Requests about a prefill this rank does not hold yet (the hold reaches the worker one
engine step after the prefill finished, the params may be faster) wait up to
`unknown_grace_s` for it before the answer is "unknown".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvferry.connector.nixl.channel import Inbound, Server
from kvferry.connector.nixl.leases import Hold, LeaseTable
from kvferry.connector.nixl.protocol import (
    UNKNOWN,
    Ack,
    Check,
    CheckReply,
    Done,
    EngineInfo,
    Handshake,
    HandshakeReply,
    Heartbeat,
    Release,
)

logger = logging.getLogger(__name__)


@dataclass
class _Waiting:
    deadline: float
    identity: bytes
    message: Check | Done


class ProducerService:
    def __init__(self, server: Server, info: EngineInfo, table: LeaseTable, grace_s: float):
        self.server = server
        self.info = info
        self.table = table
        self.grace_s = grace_s
        self.waiting: list[_Waiting] = []

    @property
    def busy(self) -> bool:
        """Leases or questions outstanding: the agent must be progressed, often."""
        return bool(len(self.table) or self.waiting)

    def hold(self, holds: list[Hold]) -> None:
        now, wall = time.monotonic(), time.time()
        for h in holds:
            self.table.add(h, now, wall)
        if holds and self.waiting:
            self._retry(now, final=False)

    def release(self, request_ids: list[str]) -> None:
        """The engine's own release: nobody will read these prefills (their client left)."""
        for request_id in request_ids:
            self.table.release(request_id, "released: its client left")

    def serve(self) -> None:
        now = time.monotonic()
        for inbound in self.server.receive():
            self._handle(inbound, now)

    def tick(self) -> None:
        now = time.monotonic()
        if self.waiting:
            self._retry(now, final=False)
        self.table.expire(now)

    def _handle(self, inbound: Inbound, now: float) -> None:
        identity, message = inbound.identity, inbound.message
        if isinstance(message, Done) and message.consumer_id != inbound.peer:
            why = f"consumer_id {message.consumer_id!r} is not the authenticated engine {inbound.peer!r}"
            self.server.reply(identity, Ack(message.seq, False, why))
        elif isinstance(message, Handshake):
            self.server.reply(identity, HandshakeReply(message.seq, self.info))
        elif isinstance(message, Heartbeat):
            self.table.heartbeat(message.request_ids, now)
        elif isinstance(message, Release):
            self.table.release(message.request_id, "released by the decoder")
        elif isinstance(message, Check | Done):
            if not self._answer(identity, message, now, final=False):
                self.waiting.append(_Waiting(now + self.grace_s, identity, message))
        else:  # Hello and Auth: the gate answers them before they get here
            logger.warning("side channel: a %s past authentication dropped", type(message).__name__)

    def _answer(self, identity: bytes, message: Check | Done, now: float, final: bool) -> bool:
        """Reply if the prefill is known here (or `final`); False: wait for its hold."""
        reply: CheckReply | Ack
        if isinstance(message, Check):
            status, why = self.table.check(
                message.request_id, message.block_ids, message.num_tokens, message.token_hash, now
            )
            if status is UNKNOWN and not final:
                return False
            reply = CheckReply(message.seq, status, why, self.info.lease_s)
        else:
            verdict = self.table.done(
                message.request_id,
                message.consumer_id,
                message.consumer_rank,
                message.consumer_tp,
                message.ok,
            )
            if not verdict.known and not final:
                return False
            if not verdict.ok and message.ok:
                logger.warning("negative ACK for %s: %s", message.request_id, verdict.message)
            reply = Ack(message.seq, verdict.ok, verdict.message)
        self.server.reply(identity, reply)
        return True

    def _retry(self, now: float, final: bool) -> None:
        still = []
        for w in self.waiting:
            if not self._answer(w.identity, w.message, now, final=final or w.deadline <= now):
                still.append(w)
        self.waiting = still
