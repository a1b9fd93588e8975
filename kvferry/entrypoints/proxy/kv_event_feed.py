"""Follows one instance's KV events (kvferry.engine.kv_event_publisher) into the PrefixIndex.

A SUB socket takes the live batches; a gap in their sequence numbers (a batch the socket
dropped, or those sent before the proxy connected) is filled from the instance's replay
socket. A new run of the instance (its /health names another run: `runs` counts them; or
its sequence numbers go back) makes the index forget what it knew of it and relearn it from
the new run's first batch. A gap the replay cannot fill also forgets:
the index then under-estimates (a missed hit) rather than over-estimates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from kvferry.entrypoints.proxy.prefix_index import PrefixIndex
from kvferry.scheduler.kv_events import KV_EVENT_DECODER, KVEventBatch

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class EventSource:
    """Where an instance (by its HTTP URL) publishes its KV events."""

    url: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @classmethod
    def parse(cls, url: str, spec: str) -> EventSource:
        """`ENDPOINT[,REPLAY_ENDPOINT]`, e.g. tcp://10.0.0.5:5557,tcp://10.0.0.5:5558."""
        endpoint, _, replay = spec.partition(",")
        return cls(url, endpoint, replay or None)


class EventFeed:
    """One instance's events, applied to the index as they come (run() until cancelled)."""

    def __init__(
        self,
        source: EventSource,
        index: PrefixIndex,
        ctx: zmq.asyncio.Context,
        runs: Callable[[], int] = lambda: 0,
    ):
        """`runs`: how many times the proxy saw the instance restart (its health checks)."""
        self.source = source
        self.index = index
        self.ctx = ctx
        self.runs = runs
        self._run = runs()
        self.next_seq = 0  # the batch expected next
        self.num_batches = 0
        self.num_resets = 0  # restarts seen and gaps that could not be filled

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    logger.warning("%s: malformed KV event message (%d frames)", self.source.url, len(frames))
                    continue
                await self._receive(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)

    async def _receive(self, seq: int, payload: bytes) -> None:
        if self.runs() != self._run:
            self._run = self.runs()
            logger.info("%s restarted: relearning its cache", self.source.url)
            self._reset(0)
        elif seq < self.next_seq:
            logger.info(
                "%s restarted (KV event %d after %d): relearning its cache",
                self.source.url,
                seq,
                self.next_seq,
            )
            self._reset(0)
        if seq > self.next_seq:
            await self._catch_up(seq)
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch: KVEventBatch = KV_EVENT_DECODER.decode(payload)
        except msgspec.DecodeError as exc:
            logger.warning("%s: undecodable KV event batch %d: %s", self.source.url, seq, exc)
            self._reset(seq + 1)
            return
        self.index.apply(self.source.url, batch)
        self.next_seq = seq + 1
        self.num_batches += 1

    def _reset(self, next_seq: int) -> None:
        self.index.forget(self.source.url)
        self.next_seq = next_seq
        self.num_resets += 1

    async def _catch_up(self, seq: int) -> None:
        """Batches next_seq .. seq-1 from the replay socket; what it lacks resets the index."""
        missing_from = self.next_seq
        replayed = await self._replay(missing_from) if self.source.replay_endpoint else []
        for number, payload in replayed:
            if number == self.next_seq and number < seq:
                self._apply(number, payload)
        if self.next_seq != seq:
            if missing_from or self.index.num_blocks(self.source.url):
                logger.warning(
                    "%s: KV events %d..%d lost: forgetting its cache", self.source.url, missing_from, seq - 1
                )
            self._reset(seq)

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.source.replay_endpoint or "")
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) != 3 or frames[1] == END_OF_REPLAY:
                    return out
                out.append((int.from_bytes(frames[1], "big"), frames[2]))
        except TimeoutError:
            logger.warning("%s: no answer from the KV event replay socket", self.source.url)
            return out
        finally:
            dealer.close(linger=0)


async def follow_all(feeds: list[EventFeed]) -> None:
    """Run every feed until cancelled (each one's failure is logged, not fatal to the others)."""
    results = await asyncio.gather(*(feed.run() for feed in feeds), return_exceptions=True)
    for feed, result in zip(feeds, results, strict=True):
        if isinstance(result, Exception):
            logger.error("KV events of %s stopped: %s", feed.source.url, result)
