"""Publishes the engine's KV events on ZMQ, in vLLM's `--kv-events-config` wire format.

The engine core hands each step's events to `publish`, which only puts the batch on a
bounded queue (never blocking: a full queue drops the batch and counts it). A thread
encodes each batch (msgpack, kvferry.scheduler.kv_events), numbers it, and sends it on a
PUB socket as three frames: `[topic, sequence number (8 bytes, big-endian), payload]`.
It keeps the last `buffer_steps` payloads: a client of the ROUTER replay socket sends a
starting sequence number (8 bytes, big-endian) and gets back every buffered batch from
there, one `[seq, payload]` message each, then `[-1 (8 bytes, signed), b""]`.

A dropped batch would leave subscribers with a view that is wrong in ways they cannot
see (a removal missed), so the next batch that gets through starts with
`AllBlocksCleared`: a subscriber forgets this instance's blocks and relearns them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from kvferry.config import KVEventsConfig
from kvferry.scheduler.kv_events import (
    KV_EVENT_ENCODER,
    AllBlocksCleared,
    KVEventBatch,
    KVEventsList,
)

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.02  # how long the thread waits for a batch before looking at replay requests


def should_bind(endpoint: str, bind: bool | None) -> bool:
    """vLLM's rule unless told: bind a wildcard (`*`, `::`) or ipc/inproc address, else connect."""
    if bind is not None:
        return bind
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The PUB and ROUTER sockets and the thread that serves them."""

    def __init__(self, config: KVEventsConfig):
        self.config = config
        self.num_dropped = 0  # batches the queue had no room for
        self.num_queued = 0  # batches publish() put on the queue (counted on the engine's thread)
        self.num_published = 0
        self._lost = False  # a batch was dropped: the next one starts with AllBlocksCleared
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if should_bind(config.endpoint, config.bind):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        logger.info("KV events on %s (replay: %s)", config.endpoint, config.replay_endpoint or "none")

    def publish(self, events: KVEventsList) -> bool:
        """Queue one step's events; False (and counted) when the queue is full."""
        if self._lost:
            events = [AllBlocksCleared(), *events]
        try:
            self._queue.put_nowait(KVEventBatch(ts=time.time(), events=events))
        except queue.Full:
            self.num_dropped += 1
            if not self._lost:
                logger.warning("KV event queue full: batches dropped (%d so far)", self.num_dropped)
            self._lost = True
            return False
        self._lost = False
        self.num_queued += 1
        return True

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to `timeout_s`), stop the thread, close the sockets."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            logger.warning("KV event queue still full at shutdown: %d batches lost", self._queue.qsize())
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            logger.warning("KV event publisher thread did not stop in %.1fs", timeout_s)
            return  # its sockets stay with it (closing them under it is not thread-safe)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        next_seq = 0
        while True:
            self._serve_replays()
            try:
                batch = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = KV_EVENT_ENCODER.encode(batch)
            try:
                self._pub.send_multipart((self._topic, next_seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as exc:  # the batch stays in the buffer: a replay serves it
                logger.warning("KV event batch %d not sent: %s", next_seq, exc)
            self._buffer.append((next_seq, payload))
            self.num_published += 1
            next_seq += 1

    def _serve_replays(self) -> None:
        """Answer every waiting replay request: the buffered batches from its sequence number."""
        replay = self._replay
        while replay is not None and replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) < 2 or len(frames[-1]) != 8:
                logger.warning("malformed KV event replay request (%d frames)", len(frames))
                continue
            envelope, start = frames[:-1], int.from_bytes(frames[-1], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    replay.send_multipart((*envelope, seq.to_bytes(8, "big"), payload))
            replay.send_multipart((*envelope, END_OF_REPLAY, b""))
