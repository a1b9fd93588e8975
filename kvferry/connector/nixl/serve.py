"""Prefill side of a worker's side channel: handshakes, and the lease protocol.

Requests about a prefill this rank does not hold yet (the hold reaches the worker one
engine step after the prefill finished, the params may be faster) wait up to
`unknown_grace_s` for it before the answer is "unknown".

Layer-wise (a streamed prefill, held from its last chunk's step on): a Progress waits up
to its own `wait_s` for news (the hold, a layer more than the asker knows, the end); a
Done waits until the prefill finished, and its Ack carries the first token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvferry.connector.nixl.channel import Inbound, Server
from kvferry.connector.nixl.leases import Finish, Hold, Lease, LeaseTable
from kvferry.connector.nixl.progress import LayerProgress
from kvferry.connector.nixl.protocol import (
    EXPIRED,
    HELD,
    UNKNOWN,
    Ack,
    Check,
    CheckReply,
    Done,
    EngineInfo,
    Handshake,
    HandshakeReply,
    Heartbeat,
    Progress,
    ProgressReply,
    Release,
)

logger = logging.getLogger(__name__)


@dataclass
class _Waiting:
    deadline: float
    identity: bytes
    message: Check | Done | Progress


MAX_PROGRESS_WAIT_S = 5.0  # a Progress is answered this soon at the latest, news or not


class ProducerService:
    def __init__(
        self,
        server: Server,
        info: EngineInfo,
        table: LeaseTable,
        grace_s: float,
        progress: LayerProgress,
    ):
        self.server = server
        self.info = info
        self.table = table
        self.grace_s = grace_s
        self.progress = progress
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

    def finish(self, finishes: list[Finish], forgotten: list[tuple[str, str]]) -> None:
        """Streamed prefills that finished, and transfer ids that will never be held."""
        for finish in finishes:
            self.table.finish(finish)
        for transfer_id, why in forgotten:
            self.table.forget_stream(transfer_id, why)

    def take_finished(self) -> set[str]:
        """Prefills whose lease ended since the last call (their blocks may be freed)."""
        finished = self.table.take_finished()
        for request_id in finished:
            self.progress.forget(request_id)
        return finished

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
        elif isinstance(message, Progress):
            if not self._answer(identity, message, now, final=False):
                wait = min(max(message.wait_s, 0.0), MAX_PROGRESS_WAIT_S)
                self.waiting.append(_Waiting(now + wait, identity, message))
        elif isinstance(message, Check | Done):
            if not self._answer(identity, message, now, final=False):
                deadline = now + self.grace_s
                if isinstance(message, Done) and self.table.waits_for_final(message.request_id):
                    deadline = now + self.info.lease_s  # its prefill's end; the lease bounds it
                self.waiting.append(_Waiting(deadline, identity, message))
        else:  # Hello and Auth: the gate answers them before they get here
            logger.warning("side channel: a %s past authentication dropped", type(message).__name__)

    def _answer(self, identity: bytes, message: Check | Done | Progress, now: float, final: bool) -> bool:
        """Reply if the prefill is known here (or `final`); False: wait for its hold."""
        reply: CheckReply | ProgressReply | Ack
        if isinstance(message, Progress):
            progress = self._progress(message, news_only=not final)
            if progress is None:
                return False
            reply = progress
        elif isinstance(message, Check):
            status, why = self.table.check(
                message.request_id, message.block_ids, message.num_tokens, message.token_hash, now
            )
            if status is UNKNOWN and not final:
                return False
            reply = CheckReply(message.seq, status, why, self.info.lease_s)
        else:
            if self.table.waits_for_final(message.request_id) and not final:
                return False
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
            lease = self.table.lookup(message.request_id)
            first = lease.first_token if lease is not None else None
            reply = Ack(message.seq, verdict.ok, verdict.message, first)
        self.server.reply(identity, reply)
        return True

    def _progress(self, message: Progress, news_only: bool = True) -> ProgressReply | None:
        """The reply to a Progress; None (with `news_only`) while nothing is new to the asker."""
        lease = self.table.lookup(message.request_id)
        if lease is None:
            gone = self.table.gone.get(message.request_id)
            if gone is not None:
                return ProgressReply(
                    message.seq, EXPIRED, f"prefill {message.request_id} is no longer held ({gone})"
                )
            if news_only:
                return None
            return ProgressReply(
                message.seq, UNKNOWN, f"no prefill {message.request_id} is held by this engine"
            )
        layers = self._final_layers(lease)
        if news_only and not lease.final and len(layers) <= message.known_layers:
            return None
        hold = lease.hold
        self.table.heartbeat([hold.request_id], time.monotonic())
        return ProgressReply(
            message.seq,
            HELD,
            block_ids=[list(ids) for ids in hold.block_ids],
            num_tokens=hold.num_tokens,
            token_hash=hold.token_hash,
            layers=layers,
            final=lease.final,
            first_token=lease.first_token,
            lease_s=self.info.lease_s,
        )

    def _final_layers(self, lease: Lease) -> list[str]:
        """The layers whose KV a decoder may read: as the forward saved them; at the end,
        those and then every other layer (one its hooks did not report)."""
        saved = self.progress.layers(lease.hold.request_id)
        if not lease.final:
            return saved
        seen = set(saved)
        return saved + [name for g in self.info.groups for name in g.layer_names if name not in seen]

    def _retry(self, now: float, final: bool) -> None:
        still = []
        for w in self.waiting:
            if not self._answer(w.identity, w.message, now, final=final or w.deadline <= now):
                still.append(w)
        self.waiting = still
