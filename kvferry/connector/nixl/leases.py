"""Prefill side: the leases under which finished prefills keep their KV blocks (invariant 6).

One LeaseTable per prefill worker (TP rank), driven by that worker's side-channel thread.
A lease starts when the scheduler half's hold reaches the worker and ends when every
decode rank that reads from this rank reported done, when the decoder (or the engine,
its client gone) releases it, or when it expires. Its end puts the request in `finished` (the scheduler then frees the
blocks). A decode rank's Done is acknowledged only while the lease holds: the blocks were
held for the whole read. After the end, every Done gets a negative acknowledgement.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from kvferry.connector.nixl.plan import overlaps
from kvferry.connector.nixl.protocol import EXPIRED, HELD, MISMATCH, UNKNOWN, CheckStatus
from kvferry.model.layers.parallel import kv_head_range

logger = logging.getLogger(__name__)

MAX_GONE = 8192  # ended leases remembered (for clear negative acknowledgements)


@dataclass(frozen=True)
class Hold:
    """Scheduler half -> worker: keep these blocks for a decoder."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    token_hash: str
    lease_s: float
    expiry: float  # unix time
    # Layer-wise: the id the decoder knows this prefill by (params.py), and whether the hold
    # starts before the prefill's forward (its layers become final one by one; `Finish`
    # tells its end).
    transfer_id: str | None = None
    streamed: bool = False


@dataclass(frozen=True)
class Finish:
    """Scheduler half -> worker: a streamed prefill finished; every layer is final."""

    request_id: str
    first_token: int | None


@dataclass
class Lease:
    hold: Hold
    deadline: float  # monotonic
    final: bool = True  # a streamed hold is final once its prefill finished
    first_token: int | None = None
    expected: frozenset[tuple[str, int]] | None = None  # (decode engine, rank) that read here
    reported: set[tuple[str, int]] = field(default_factory=set)


def readers_of(rank: int, tp: int, consumer_tp: int, total_heads: int) -> list[int]:
    """Decode ranks whose KV heads overlap those of prefill rank `rank`."""
    mine = kv_head_range(rank, tp, total_heads)
    return [d for d in range(consumer_tp) if overlaps(mine, kv_head_range(d, consumer_tp, total_heads))]


def read_sources(rank: int, tp: int, producer_tp: int, total_heads: int) -> list[int]:
    """The prefill ranks decode rank `rank` (of `tp`) READs from: for each of its KV heads,
    one prefill rank holding it. A head replicated on several prefill ranks (fewer heads than
    ranks; a latent-attention cache: one row every rank holds) is read once, from the
    replica `rank` picks round-robin, never once per replica. The decode rank still reports
    to every prefill rank whose heads overlap its own (`readers_of`): their leases end."""
    start, count = kv_head_range(rank, tp, total_heads)
    chosen: set[int] = set()
    for head in range(start, start + count):
        holders = [
            p for p in range(producer_tp) if overlaps((head, 1), kv_head_range(p, producer_tp, total_heads))
        ]
        chosen.add(holders[rank % len(holders)])
    return sorted(chosen)


@dataclass
class Verdict:
    known: bool  # False: not held here (yet) -- the caller may wait for the hold
    ok: bool = False
    message: str = ""


class LeaseTable:
    def __init__(self, rank: int, tp: int, total_heads: int):
        self.rank = rank
        self.tp = tp
        self.total_heads = total_heads
        self.leases: dict[str, Lease] = {}
        self.aliases: dict[str, str] = {}  # transfer id -> request id, while held
        self.gone: OrderedDict[str, str] = OrderedDict()  # ended leases -> why
        self.finished: set[str] = set()  # ended since the last take_finished()
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self.leases)

    def add(self, hold: Hold, now: float, wall_now: float) -> None:
        if hold.request_id in self.leases:
            logger.warning("prefill %s is already held", hold.request_id)
            return
        self.gone.pop(hold.request_id, None)
        deadline = now + max(0.0, hold.expiry - wall_now)
        self.leases[hold.request_id] = Lease(hold, deadline, final=not hold.streamed)
        if hold.transfer_id is not None:
            self.gone.pop(hold.transfer_id, None)
            self.aliases[hold.transfer_id] = hold.request_id

    def finish(self, finish: Finish) -> None:
        """A streamed prefill finished (its first token is known); unknown ids are ignored."""
        lease = self.leases.get(finish.request_id)
        if lease is not None:
            lease.final = True
            lease.first_token = finish.first_token

    def lookup(self, request_id: str) -> Lease | None:
        """The lease of a request id or of a transfer id."""
        lease = self.leases.get(request_id)
        if lease is None and request_id in self.aliases:
            lease = self.leases.get(self.aliases[request_id])
        return lease

    def forget_stream(self, transfer_id: str, why: str) -> None:
        """A streamed prefill that will never be held (it ended before its last chunk ran)."""
        self._remember(transfer_id, why)

    def check(
        self, request_id: str, block_ids: list[list[int]], num_tokens: int, token_hash: str, now: float
    ) -> tuple[CheckStatus, str]:
        """(status, message) for a decoder about to read; a held lease is extended."""
        lease = self.lookup(request_id)
        if lease is None:
            if request_id in self.gone:
                return EXPIRED, f"prefill {request_id} is no longer held ({self.gone[request_id]})"
            return UNKNOWN, f"no prefill {request_id} is held by this engine"
        hold = lease.hold
        if [list(g) for g in hold.block_ids] != block_ids:
            return MISMATCH, "remote_block_ids do not match the blocks the prefill holds"
        if hold.num_tokens != num_tokens:
            return MISMATCH, f"remote_num_tokens is {num_tokens}, the prefill holds {hold.num_tokens}"
        if hold.token_hash != token_hash:
            return MISMATCH, "the prompt does not match the tokens the prefill computed"
        self._extend(lease, now)
        return HELD, ""

    def heartbeat(self, request_ids: list[str], now: float) -> None:
        for request_id in request_ids:
            lease = self.lookup(request_id)
            if lease is not None:
                self._extend(lease, now)

    def _extend(self, lease: Lease, now: float) -> None:
        lease.deadline = max(lease.deadline, now + lease.hold.lease_s)

    def done(self, request_id: str, consumer_id: str, rank: int, consumer_tp: int, ok: bool) -> Verdict:
        """A decode rank finished (ok) or abandoned its read. ACK iff the lease still holds.
        (A streamed prefill answers only once final: the caller waits, see `waits_for_final`.)"""
        lease = self.lookup(request_id)
        if lease is None:
            if request_id in self.gone:
                return Verdict(
                    True, False, f"prefill {request_id} is no longer held ({self.gone[request_id]})"
                )
            return Verdict(False, False, f"no prefill {request_id} is held by this engine")
        if lease.expected is None:
            readers = readers_of(self.rank, self.tp, consumer_tp, self.total_heads)
            lease.expected = frozenset((consumer_id, d) for d in readers)
        reader = (consumer_id, rank)
        if reader not in lease.expected:
            return Verdict(True, False, f"decode rank {rank} of {consumer_id} does not read from this rank")
        lease.reported.add(reader)
        if lease.reported >= lease.expected:
            self._end(lease.hold.request_id, "read by the decoder")
        return Verdict(True, ok, "")

    def waits_for_final(self, request_id: str) -> bool:
        """Whether a Done about this prefill must wait: streamed, and not finished yet."""
        lease = self.lookup(request_id)
        return lease is not None and not lease.final

    def release(self, request_id: str, why: str) -> None:
        """End a lease nobody will read under (idempotent: an ended or unknown one is left)."""
        lease = self.lookup(request_id)
        if lease is not None:
            self._end(lease.hold.request_id, why)

    def expire(self, now: float) -> list[str]:
        expired = [rid for rid, lease in self.leases.items() if lease.deadline <= now]
        for request_id in expired:
            logger.warning("lease of prefill %s expired; its blocks are freed", request_id)
            self._end(request_id, "lease expired")
        self.num_expired += len(expired)
        return expired

    def _end(self, request_id: str, why: str) -> None:
        lease = self.leases.pop(request_id)
        self.finished.add(request_id)
        self._remember(request_id, why)
        if lease.hold.transfer_id is not None:
            self.aliases.pop(lease.hold.transfer_id, None)
            self._remember(lease.hold.transfer_id, why)

    def _remember(self, request_id: str, why: str) -> None:
        self.gone[request_id] = why
        while len(self.gone) > MAX_GONE:
            self.gone.popitem(last=False)

    def take_finished(self) -> set[str]:
        finished, self.finished = self.finished, set()
        return finished
