"""The storage tiers of one worker: a DRAM buffer and a disk file, both of fixed-size slots.

Each slot carries a tag (block hash, epoch of the save that wrote it, optional payload
crc32): in memory for DRAM, in a 64-byte header in front of the payload on disk. A load
names the tag it expects; a slot whose tag differs (never written, a failed or torn
write, reused since) is a load error, never garbage KV. A write first invalidates the
tag, then writes the payload, then the tag.

The payload itself is not checksummed unless `verify_checksum` is on: checking costs a
pass over every loaded byte, and the tag already catches stale and misdirected slots.

Reads and writes may name byte ranges of the slot (`Ranges`: the KV cache groups a block
position holds or a load needs); None is the whole slot. A checksum covers the ranges
written, so a checked read names the same ranges.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import tempfile
import zlib
from dataclasses import dataclass

import torch

from kvferry.errors import ConfigError

logger = logging.getLogger(__name__)

MAGIC = b"KVFSLOT1"
HEADER = struct.Struct("<8s32sQI")  # magic, block hash (32 bytes), epoch, payload crc32
HEADER_SIZE = 64
INVALID_HEADER = bytes(HEADER_SIZE)

Ranges = list[tuple[int, int]] | None  # byte ranges of a slot; None: all of it


@dataclass(frozen=True)
class Tag:
    block_hash: bytes
    epoch: int
    crc: int = 0  # 0 when checksums are off


def payload_crc(row: torch.Tensor, ranges: Ranges = None) -> int:
    data = row.numpy().data
    crc = 0
    for start, stop in _spans(ranges, len(data)):
        crc = zlib.crc32(data[start:stop], crc)
    return crc


def _spans(ranges: Ranges, size: int) -> list[tuple[int, int]]:
    return [(0, size)] if ranges is None else ranges


def _hash32(block_hash: bytes) -> bytes:
    return block_hash[:32].ljust(32, b"\0")


class DramTier:
    def __init__(self, num_slots: int, slot_bytes: int, pin_memory: bool = False):
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        # Not zeroed: pages are touched when a slot is first written.
        self.buffer = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self._tags: list[Tag | None] = [None] * num_slots

    def write(self, slots: list[int], rows: torch.Tensor, tags: list[Tag], ranges: Ranges = None) -> None:
        for slot in slots:
            self._tags[slot] = None
        index = torch.tensor(slots, dtype=torch.int64)
        if ranges is None:
            self.buffer.index_copy_(0, index, rows)
        for start, stop in ranges or ():
            self.buffer[:, start:stop].index_copy_(0, index, rows[:, start:stop])
        for slot, tag in zip(slots, tags, strict=True):
            self._tags[slot] = tag

    def read(self, slot: int, out: torch.Tensor, ranges: Ranges = None) -> None:
        for start, stop in _spans(ranges, self.slot_bytes):
            out[start:stop].copy_(self.buffer[slot, start:stop])

    def invalidate(self, slot: int) -> None:
        self._tags[slot] = None

    def check(self, slot: int, tag: Tag, verify_checksum: bool, ranges: Ranges = None) -> bool:
        """Whether the slot holds exactly the save the caller expects (`ranges`: what it wrote)."""
        held = self._tags[slot]
        if held is None or held.block_hash != tag.block_hash or held.epoch != tag.epoch:
            return False
        return not verify_checksum or payload_crc(self.buffer[slot], ranges) == held.crc

    def tag(self, slot: int) -> Tag | None:
        return self._tags[slot]


class DiskTier:
    """One file per worker (rank) in `directory`, removed at close."""

    def __init__(self, directory: str, num_slots: int, slot_bytes: int, rank: int = 0):
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.stride = HEADER_SIZE + -(-slot_bytes // HEADER_SIZE) * HEADER_SIZE
        size = num_slots * self.stride
        free = shutil.disk_usage(directory).free
        if size > free:
            raise ConfigError(f"offload: disk tier needs {size} bytes but {directory!r} has {free} free")
        fd, self.path = tempfile.mkstemp(prefix=f"kvferry-offload-rank{rank}-", suffix=".bin", dir=directory)
        self._fd: int | None = fd
        os.ftruncate(fd, size)  # sparse; every header reads as invalid until written
        logger.info("offload disk tier: %s, %d slots of %d bytes", self.path, num_slots, slot_bytes)

    def payload_offset(self, slot: int) -> int:
        return slot * self.stride + HEADER_SIZE

    def write(self, slot: int, row: torch.Tensor, tag: Tag, ranges: Ranges = None) -> None:
        """row: contiguous uint8 [slot_bytes] on the CPU."""
        fd = self._require_fd()
        base = slot * self.stride
        _pwrite_all(fd, INVALID_HEADER, base)
        data = row.numpy().data
        for start, stop in _spans(ranges, self.slot_bytes):
            _pwrite_all(fd, data[start:stop], base + HEADER_SIZE + start)
        header = HEADER.pack(MAGIC, _hash32(tag.block_hash), tag.epoch, tag.crc)
        _pwrite_all(fd, header.ljust(HEADER_SIZE, b"\0"), base)

    def invalidate(self, slot: int) -> None:
        _pwrite_all(self._require_fd(), INVALID_HEADER, slot * self.stride)

    def read(
        self, slot: int, out: torch.Tensor, tag: Tag, verify_checksum: bool, ranges: Ranges = None
    ) -> bool:
        """Read the slot's `ranges` into out (contiguous uint8 [slot_bytes]); False if it is not
        `tag`'s save. A checked read names the ranges the save wrote."""
        fd = self._require_fd()
        base = slot * self.stride
        raw = os.pread(fd, HEADER.size, base)
        if len(raw) != HEADER.size:
            return False
        magic, block_hash, epoch, crc = HEADER.unpack(raw)
        if magic != MAGIC or block_hash != _hash32(tag.block_hash) or epoch != tag.epoch:
            return False
        view = out.numpy().data
        for start, stop in _spans(ranges, self.slot_bytes):
            if os.preadv(fd, [view[start:stop]], base + HEADER_SIZE + start) != stop - start:
                return False
        return not verify_checksum or payload_crc(out, ranges) == crc

    def close(self) -> None:
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _require_fd(self) -> int:
        if self._fd is None:
            raise OSError(f"offload disk tier {self.path} is closed")
        return self._fd


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(f"short write at offset {offset}")
        view, offset = view[written:], offset + written
