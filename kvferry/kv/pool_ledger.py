"""The ledger file of a shared KV memory pool (kvferry.kv.shared_pool): its format, and
opening it safely in a directory every local user may write to (/dev/shm).

Format (little-endian, 4128 bytes): a header (magic, format version, slot count, pool size
in bytes, CRC-32 of those) and `NUM_SLOTS` slots of 32 bytes (pid, the process's start
time, bytes held, CRC-32 of the slot's index and fields). A free slot is all zeros. Any
other content (a wrong magic or checksum, a slot holding more than the pool, slots holding
more than the pool together) is damage: `read` raises KVPoolLedgerError naming the pool,
the file and what is wrong.

Creation: the first engine writes the whole ledger, its own slot included, into an unnamed
file (O_TMPFILE, mode 0600) and links it under the pool's name only then; the link fails
if anything is there already (a symlink included), so a ledger is never seen half written
and never created through a link. Opening: O_NOFOLLOW, then `fstat` of what was opened
must say a regular file of this user, mode 0600, one link, the ledger's size.

Locks: `locked()` is an exclusive `flock` of the whole file, held for every change. Each
engine also holds an open-file-description lock (F_OFD_SETLK) on its own slot's bytes for
as long as it is attached: the kernel drops it when the process dies, so `slot_attached`
tells a slot written by an attached engine from bytes written by anything else.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvferry.errors import ConfigError

MAGIC = int.from_bytes(b"kvfpool!", "little")
VERSION = 2  # version 1 ("kvferry1"): no version, no checksums
NUM_SLOTS = 128
_HEADER = struct.Struct("<QIIQI4x")  # magic, version, slots, pool size, CRC-32 of the four
_SLOT = struct.Struct("<qQQI4x")  # pid, process start time, bytes held, CRC-32 (index, three)
SLOT_BYTES = _SLOT.size
FILE_BYTES = _HEADER.size + NUM_SLOTS * SLOT_BYTES
_FREE = bytes(SLOT_BYTES)
_FLOCK = struct.Struct("@hhqqi4x")  # Linux `struct flock`: type, whence, start, length, pid
_MODE = 0o600
_REFUSED = (
    "refused (kvferry creates its ledger itself, owner-only; remove the file once no engine uses the pool)"
)


class KVPoolLedgerError(ConfigError):
    """The pool's ledger cannot be trusted: not this user's file, not a ledger, or in a state
    no engine writes."""

    def __init__(self, pool: str, path: Path, problem: str):
        super().__init__(f"KV memory pool {pool!r} ({path}): {problem}")
        self.pool = pool
        self.path = path
        self.problem = problem


class LedgerDamage(ValueError):
    """What is wrong with a ledger's bytes (LedgerFile.read names the pool around it)."""


@dataclass(frozen=True)
class Slot:
    """One attached engine: its process, and the bytes the pool granted it."""

    pid: int  # 0: free
    started: int  # the process's start time, clock ticks since boot
    held: int  # bytes

    @property
    def is_free(self) -> bool:
        return self.pid == 0


FREE = Slot(0, 0, 0)


@dataclass(frozen=True)
class LedgerState:
    size_bytes: int
    slots: tuple[Slot, ...]

    @property
    def used_bytes(self) -> int:
        return sum(slot.held for slot in self.slots)


def slot_offset(index: int) -> int:
    return _HEADER.size + index * SLOT_BYTES


def encode_header(size_bytes: int) -> bytes:
    fields = (MAGIC, VERSION, NUM_SLOTS, size_bytes)
    return _HEADER.pack(*fields, zlib.crc32(_HEADER.pack(*fields, 0)[:-8]))


def encode_slot(index: int, slot: Slot) -> bytes:
    if slot.is_free:
        return _FREE
    fields = (slot.pid, slot.started, slot.held)
    salt = index.to_bytes(4, "little")  # a slot copied to another index does not check out
    return _SLOT.pack(*fields, zlib.crc32(salt + _SLOT.pack(*fields, 0)[:-8]))


def decode_slot(data: bytes, index: int) -> Slot | None:
    """Slot `index` of a ledger's bytes; None when its bytes are not what an engine writes."""
    raw = data[slot_offset(index) : slot_offset(index) + SLOT_BYTES]
    if raw == _FREE:
        return FREE
    if len(raw) != SLOT_BYTES:
        return None
    pid, started, held, _ = _SLOT.unpack(raw)
    slot = Slot(pid, started, held)
    return slot if pid > 0 and started > 0 and encode_slot(index, slot) == raw else None


def parse(data: bytes) -> LedgerState:
    """A ledger's state from its bytes; raises LedgerDamage saying what is wrong."""
    if len(data) != FILE_BYTES:
        raise LedgerDamage(f"the ledger is {len(data)} bytes, not {FILE_BYTES}")
    magic, version, num_slots, size, _ = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise LedgerDamage("not a kvferry KV pool ledger (wrong magic number)")
    if version != VERSION:
        raise LedgerDamage(f"ledger format version {version}; this kvferry reads version {VERSION}")
    if data[: _HEADER.size] != encode_header(size) or num_slots != NUM_SLOTS or size <= 0:
        raise LedgerDamage("the ledger's header is damaged (checksum, slot count or pool size)")
    slots = []
    for index in range(NUM_SLOTS):
        slot = decode_slot(data, index)
        if slot is None:
            raise LedgerDamage(f"slot {index} is damaged (its checksum does not match its bytes)")
        if slot.held > size:
            raise LedgerDamage(f"slot {index} (pid {slot.pid}) holds {slot.held} bytes, more than the pool")
        slots.append(slot)
    state = LedgerState(size, tuple(slots))
    if state.used_bytes > size:
        raise LedgerDamage(f"the slots hold {state.used_bytes} bytes together, more than the pool ({size})")
    return state


class LedgerFile:
    """An open ledger that passed the file checks."""

    def __init__(self, fd: int, pool: str, path: Path):
        self.fd = fd
        self.pool = pool
        self.path = path

    def error(self, problem: str) -> KVPoolLedgerError:
        return KVPoolLedgerError(self.pool, self.path, problem)

    @classmethod
    def create(cls, pool: str, path: Path, size_bytes: int, first: Slot) -> LedgerFile | None:
        """A new ledger of `size_bytes`, `first` in slot 0 (its slot lock held): None when the
        name is taken (by a ledger or by anything else)."""
        try:
            fd = os.open(path.parent, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, _MODE)
        except OSError as exc:
            raise KVPoolLedgerError(pool, path, f"cannot create the ledger: {exc.strerror}") from exc
        ledger = cls(fd, pool, path)
        try:
            os.fchmod(fd, _MODE)  # whatever the umask
            contents = encode_header(size_bytes) + encode_slot(0, first)
            os.pwrite(fd, contents.ljust(FILE_BYTES, b"\0"), 0)
            if not ledger.lock_slot(0):
                raise ledger.error("a file nobody else opened has its first slot locked")
            if ledger._link():
                return ledger
        except BaseException:
            ledger.close()
            raise
        ledger.close()
        return None

    def _link(self) -> bool:
        """Give the unnamed file the pool's name; False when the name is taken."""
        directory = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.link(f"/proc/self/fd/{self.fd}", self.path.name, dst_dir_fd=directory)
        except FileExistsError:
            return False
        except OSError as exc:
            raise self.error(f"cannot create the ledger: {exc.strerror}") from exc
        finally:
            os.close(directory)
        return True

    @classmethod
    def open_existing(cls, pool: str, path: Path, writable: bool = True) -> LedgerFile | None:
        """The ledger under `path` if it passes the file checks; None when nothing is there."""
        flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            fd = os.open(path, flags | (os.O_RDWR if writable else os.O_RDONLY))
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise KVPoolLedgerError(pool, path, f"is a symbolic link: {_REFUSED}") from None
            raise KVPoolLedgerError(pool, path, f"cannot be opened: {exc.strerror}") from None
        ledger = cls(fd, pool, path)
        try:
            ledger._check_file()
        except BaseException:
            ledger.close()
            raise
        return ledger

    def _check_file(self) -> None:
        """What was opened (fstat: not the name, which may have changed since) is a ledger
        this engine could have created."""
        info = os.fstat(self.fd)
        mode = stat.S_IMODE(info.st_mode)
        if not stat.S_ISREG(info.st_mode):
            problem = "is not a regular file"
        elif info.st_uid != os.geteuid():
            problem = f"is owned by uid {info.st_uid}, not by this engine's user (uid {os.geteuid()})"
        elif mode != _MODE:
            problem = f"has mode {mode:04o}, not 0600"
        elif info.st_nlink > 1:
            problem = f"has {info.st_nlink} hard links, not one"
        elif info.st_size != FILE_BYTES:
            problem = f"is {info.st_size} bytes, not a ledger's {FILE_BYTES}"
        else:
            return
        raise self.error(f"{problem}: {_REFUSED}")

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The ledger's exclusive lock, for a read-check-write of the slots."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def is_linked(self) -> bool:
        """Whether the file is still the pool's: the last engine to leave removes it, under
        the lock, so a file opened just before and locked just after is not (no link left)."""
        return os.fstat(self.fd).st_nlink > 0

    def read(self) -> LedgerState:
        """The whole ledger, checked (under the lock: a read beside a write may be torn)."""
        try:
            return parse(os.pread(self.fd, FILE_BYTES + 1, 0))
        except LedgerDamage as exc:
            raise self.error(str(exc)) from None

    def read_slot(self, index: int) -> Slot | None:
        return decode_slot(os.pread(self.fd, FILE_BYTES, 0), index)

    def intact_slots(self) -> list[Slot]:
        """The slots whose bytes check out, read without the lock (for statistics only)."""
        data = os.pread(self.fd, FILE_BYTES, 0)
        return [slot for index in range(NUM_SLOTS) if (slot := decode_slot(data, index)) is not None]

    def write_slot(self, index: int, slot: Slot) -> None:
        os.pwrite(self.fd, encode_slot(index, slot), slot_offset(index))

    def lock_slot(self, index: int) -> bool:
        """Take slot `index`'s lock (held until this file is closed); False if another open
        file holds it (e.g. a forked child of an engine that died)."""
        try:
            self._slot_lock(fcntl.F_OFD_SETLK, index)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def slot_attached(self, index: int) -> bool:
        """Whether an engine's open ledger holds slot `index`'s lock (not this file's)."""
        return self._slot_lock(fcntl.F_OFD_GETLK, index) != fcntl.F_UNLCK

    def _slot_lock(self, command: int, index: int) -> int:
        request = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, slot_offset(index), SLOT_BYTES, 0)
        lock_type: int = _FLOCK.unpack(fcntl.fcntl(self.fd, command, request))[0]
        return lock_type

    def remove(self) -> None:
        """Unlink the pool's name if it still names this file (under the lock)."""
        info = os.fstat(self.fd)
        try:
            named = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (named.st_dev, named.st_ino) == (info.st_dev, info.st_ino):
            os.unlink(self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read_pool_size(pool: str, path: Path) -> int | None:
    """The size of the pool's ledger, checked; None when there is none."""
    ledger = LedgerFile.open_existing(pool, path, writable=False)
    if ledger is None:
        return None
    try:
        with ledger.locked():
            return ledger.read().size_bytes if ledger.is_linked() else None
    finally:
        ledger.close()
