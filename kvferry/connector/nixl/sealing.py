"""Sealing side-channel messages: encrypt-then-MAC with one connection's keys, numbered.

A sealed message is ``(counter, ciphertext | tag)``:

    ciphertext = plaintext XOR SHAKE-256(encrypt key | counter)     (a keystream, never reused)
    tag        = HMAC-SHA256(mac key, counter | ciphertext)

Each direction of a connection has its own keys (auth.SessionKeys) and its own counter,
which the sender raises by one per message and the receiver requires to rise: a message
replayed, reordered, moved to another connection or the other direction, altered or
made up fails to open. Gaps are allowed (a ZMQ ROUTER may drop a reply to a full
queue); nothing is accepted twice. Standard library only: SHAKE-256 keyed with a fresh
(key, counter) is a pseudorandom keystream, HMAC-SHA256 an unforgeable tag, and the
tag is checked (in constant time) before anything is decrypted.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

from kvferry.connector.nixl.auth import DirectionKeys

logger = logging.getLogger(__name__)

TAG_BYTES = 32
COUNTER_BYTES = 8
MAX_COUNTER = (1 << (8 * COUNTER_BYTES)) - 1


class SealError(Exception):
    """A sealed message that does not open: forged, altered, replayed or out of order."""


def _keystream(key: bytes, counter: int, size: int) -> bytes:
    return hashlib.shake_256(key + counter.to_bytes(COUNTER_BYTES, "big")).digest(size)


def _xor(data: bytes, stream: bytes) -> bytes:
    size = len(data)
    return (int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")).to_bytes(size, "little")


def _tag(key: bytes, counter: int, ciphertext: bytes) -> bytes:
    return hmac.new(key, counter.to_bytes(COUNTER_BYTES, "big") + ciphertext, hashlib.sha256).digest()


class Sealer:
    """Seals one direction's messages, numbering them 0, 1, 2, ..."""

    def __init__(self, keys: DirectionKeys) -> None:
        self._keys = keys
        self._next = 0

    def seal(self, plaintext: bytes) -> tuple[int, bytes]:
        counter = self._next
        if counter > MAX_COUNTER:
            raise SealError("the session's message counter is exhausted")
        self._next += 1
        ciphertext = _xor(plaintext, _keystream(self._keys.encrypt, counter, len(plaintext)))
        return counter, ciphertext + _tag(self._keys.mac, counter, ciphertext)


class Opener:
    """Opens one direction's messages: each authentic, and numbered above the last one."""

    def __init__(self, keys: DirectionKeys) -> None:
        self._keys = keys
        self._last = -1

    def open(self, counter: int, box: bytes) -> bytes:
        if not self._last < counter <= MAX_COUNTER:
            raise SealError(f"message number {counter} is not above the last one ({self._last})")
        if len(box) < TAG_BYTES:
            raise SealError("sealed message shorter than its tag")
        ciphertext, tag = box[:-TAG_BYTES], box[-TAG_BYTES:]
        if not hmac.compare_digest(_tag(self._keys.mac, counter, ciphertext), tag):
            raise SealError("sealed message failed authentication")
        self._last = counter
        return _xor(ciphertext, _keystream(self._keys.encrypt, counter, len(ciphertext)))
