"""A KV memory pool shared by the engines of one host (`--kv-memory-pool NAME`).

The pool is a byte budget, not memory: each engine maps its own pages (elastic memory)
and asks the pool for the right to before it does, giving the bytes back when it returns
pages. The ledger is a small file in /dev/shm: a header (magic, pool size) and one slot
per attached engine (pid, the process's start time, bytes held). Changes take an
exclusive `flock` on the file. A slot whose process is gone (killed, even with -9) or
whose pid now names another process (its start time differs) is reclaimed by the next
engine that takes the lock, so a crashed engine never leaks the shared budget.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from kvferry.errors import ConfigError

logger = logging.getLogger(__name__)

_MAGIC = 0x6B76666572727931  # "kvferry1"
_HEADER = struct.Struct("<QQ")  # magic, pool size in bytes
_SLOT = struct.Struct("<qQQ")  # pid (0: free), process start time, bytes held
_NUM_SLOTS = 128
_FILE_BYTES = _HEADER.size + _NUM_SLOTS * _SLOT.size
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class KVPoolSpec:
    """Which pool an engine draws its KV pages from, and the size it expects."""

    name: str
    size_bytes: int | None = None  # None: the pool must exist already

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"--kv-memory-pool {self.name!r}: use letters, digits, '_', '.', '-' (1-64)")
        if self.size_bytes is not None and self.size_bytes <= 0:
            raise ConfigError(f"--kv-pool-size must be positive, not {self.size_bytes} bytes")

    @property
    def path(self) -> Path:
        return Path("/dev/shm") / f"kvferry-kvpool-{self.name}"


def pool_size_bytes(spec: KVPoolSpec) -> int:
    """The pool's size: the one asked for, else the existing pool's."""
    if spec.size_bytes is not None:
        return spec.size_bytes
    try:
        header = spec.path.read_bytes()[: _HEADER.size]
    except OSError:
        header = b""
    if len(header) < _HEADER.size or _HEADER.unpack(header)[0] != _MAGIC:
        raise ConfigError(f"KV memory pool {spec.name!r} does not exist: give --kv-pool-size to create it")
    size: int = _HEADER.unpack(header)[1]
    return size


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command name


class SharedKVPool:
    """This engine's slot in a host-wide KV byte budget."""

    def __init__(self, spec: KVPoolSpec):
        self.spec = spec
        self._fd = os.open(spec.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with self._locked():
                if os.fstat(self._fd).st_size < _FILE_BYTES:
                    os.ftruncate(self._fd, _FILE_BYTES)
                self._map = mmap.mmap(self._fd, _FILE_BYTES)
                self.size_bytes = self._check_header(spec)
                self._slot = self._take_slot()
        except BaseException:
            os.close(self._fd)
            raise
        logger.info("KV memory pool %r: %d bytes shared, slot %d", spec.name, self.size_bytes, self._slot)

    # ---- what the block pool asks -------------------------------------------------------

    def try_take(self, num_bytes: int) -> bool:
        """Hold `num_bytes` more if the pool has them (after reclaiming dead engines' bytes)."""
        with self._locked():
            self._reclaim_dead()
            if self.used_bytes() + num_bytes > self.size_bytes:
                return False
            self._add(num_bytes)
            return True

    def give(self, num_bytes: int) -> None:
        with self._locked():
            assert self.held_bytes() >= num_bytes, "giving back more than this engine holds"
            self._add(-num_bytes)

    def available_bytes(self) -> int:
        """What the pool could grant now (a snapshot: another engine may take it first)."""
        return max(0, self.size_bytes - self.used_bytes())

    def held_bytes(self) -> int:
        held: int = _SLOT.unpack_from(self._map, self._offset(self._slot))[2]
        return held

    def used_bytes(self) -> int:
        return sum(_SLOT.unpack_from(self._map, self._offset(i))[2] for i in range(_NUM_SLOTS))

    def close(self) -> None:
        """Give everything back and leave the pool (once)."""
        if self._map.closed:
            return
        with self._locked():
            _SLOT.pack_into(self._map, self._offset(self._slot), 0, 0, 0)
        self._map.close()
        os.close(self._fd)

    # ---- the ledger ---------------------------------------------------------------------

    def _locked(self) -> _FileLock:
        return _FileLock(self._fd)

    def _check_header(self, spec: KVPoolSpec) -> int:
        magic, stored = _HEADER.unpack_from(self._map, 0)
        size = int(stored)
        if magic != _MAGIC:
            if spec.size_bytes is None:
                raise ConfigError(
                    f"KV memory pool {spec.name!r} does not exist: give --kv-pool-size to create it"
                )
            _HEADER.pack_into(self._map, 0, _MAGIC, spec.size_bytes)
            return spec.size_bytes
        if spec.size_bytes is not None and spec.size_bytes != size:
            raise ConfigError(
                f"KV memory pool {spec.name!r} holds {size} bytes; this engine asked for {spec.size_bytes}"
            )
        return size

    def _take_slot(self) -> int:
        self._reclaim_dead()
        for index in range(_NUM_SLOTS):
            if _SLOT.unpack_from(self._map, self._offset(index))[0] == 0:
                pid = os.getpid()
                _SLOT.pack_into(self._map, self._offset(index), pid, _start_time(pid) or 0, 0)
                return index
        raise ConfigError(f"KV memory pool {self.spec.name!r} has {_NUM_SLOTS} engines attached already")

    def _reclaim_dead(self) -> None:
        for index in range(_NUM_SLOTS):
            pid, started, held = _SLOT.unpack_from(self._map, self._offset(index))
            if pid and _start_time(pid) != started:
                logger.warning(
                    "KV memory pool %r: engine pid %d is gone, %d bytes back", self.spec.name, pid, held
                )
                _SLOT.pack_into(self._map, self._offset(index), 0, 0, 0)

    def _add(self, num_bytes: int) -> None:
        offset = self._offset(self._slot)
        pid, started, held = _SLOT.unpack_from(self._map, offset)
        _SLOT.pack_into(self._map, offset, pid, started, held + num_bytes)

    @staticmethod
    def _offset(index: int) -> int:
        return _HEADER.size + index * _SLOT.size


class _FileLock:
    """An exclusive flock on the ledger for a `with` block."""

    def __init__(self, fd: int):
        self._fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)


@dataclass
class PoolPageBudget:
    """The block pool's view of a shared pool: pages of `page_bytes` (all ranks' bytes of one
    page of block ids)."""

    pool: SharedKVPool
    page_bytes: int

    def try_take(self, pages: int) -> bool:
        return self.pool.try_take(pages * self.page_bytes)

    def give(self, pages: int) -> None:
        self.pool.give(pages * self.page_bytes)

    def available(self) -> int:
        return self.pool.available_bytes() // self.page_bytes
