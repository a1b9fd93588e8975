"""A KV memory pool shared by the engines of one host (`--kv-memory-pool NAME`).

The pool is a byte budget, not memory: each engine maps its own pages (elastic memory)
and asks the pool for the right to before it does, giving the bytes back when it returns
pages. The ledger is a small file in /dev/shm (kvferry.kv.pool_ledger: its format, and how
it is created and opened safely): a header (pool size) and one slot per attached engine
(pid, the process's start time, bytes held). Changes take an exclusive `flock` on the file
and check the whole ledger first. A slot whose process is gone (killed, even with -9) or
whose pid now names another process (its start time differs) is reclaimed by the next
engine that takes the lock, so a crashed engine never leaks the shared budget. A slot of
a live process that is not attached to the pool, or bytes no engine writes, are an error
(KVPoolLedgerError) naming the pool: refused at start-up, and to the requests that need a
grant while the engine runs. The last engine to leave removes the file.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvferry.errors import ConfigError
from kvferry.kv.pool_ledger import FREE, NUM_SLOTS, LedgerFile, LedgerState, Slot, read_pool_size

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ATTACH_TRIES = 100  # a pool removed by its last engine between our open and our lock: again
_OUTSIDE = "the ledger was written outside kvferry (stop the pool's engines and remove the file)"


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

    def missing(self) -> ConfigError:
        return ConfigError(f"KV memory pool {self.name!r} does not exist: give --kv-pool-size to create it")


def pool_size_bytes(spec: KVPoolSpec) -> int:
    """The pool's size: the one asked for, else the existing pool's (its ledger checked)."""
    if spec.size_bytes is not None:
        return spec.size_bytes
    size = read_pool_size(spec.name, spec.path)
    if size is None:
        raise spec.missing()
    return size


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command name


def _this_process() -> Slot:
    pid = os.getpid()
    started = _start_time(pid)
    if started is None:
        raise ConfigError("a shared KV memory pool needs /proc (to tell live engines from dead ones)")
    return Slot(pid, started, 0)


class SharedKVPool:
    """This engine's slot in a host-wide KV byte budget."""

    def __init__(self, spec: KVPoolSpec):
        self.spec = spec
        self._me = _this_process()
        self._held = 0  # what this engine holds: the truth its slot in the ledger must show
        self._closed = False
        self._damage_logged = False
        self.ledger, self._slot, self.size_bytes = self._attach()
        logger.info("KV memory pool %r: %d bytes shared, slot %d", spec.name, self.size_bytes, self._slot)

    # ---- what the block pool asks -------------------------------------------------------

    def try_take(self, num_bytes: int) -> bool:
        """Hold `num_bytes` more if the pool has them (after reclaiming dead engines' bytes).
        Raises KVPoolLedgerError when the ledger is in a state no engine writes."""
        with self.ledger.locked():
            state = self._checked_state()
            if state.used_bytes + num_bytes > self.size_bytes:
                return False
            self._held += num_bytes
            self.ledger.write_slot(self._slot, self._own_slot())
            return True

    def give(self, num_bytes: int) -> None:
        """Give bytes back. Never raises over the ledger (a step's page changes must not be
        lost): a slot changed outside kvferry is left as it is, and the next `try_take`
        reports it."""
        assert 0 <= num_bytes <= self._held, "giving back more than this engine holds"
        with self.ledger.locked():
            intact = self.ledger.read_slot(self._slot) == self._own_slot()
            self._held -= num_bytes
            if intact:
                self.ledger.write_slot(self._slot, self._own_slot())
            elif not self._damage_logged:
                self._damage_logged = True
                logger.error("KV memory pool %r: slot %d changed: %s", self.spec.name, self._slot, _OUTSIDE)

    def available_bytes(self) -> int:
        """What the pool could grant now (a snapshot: another engine may take it first)."""
        return max(0, self.size_bytes - self.used_bytes())

    def held_bytes(self) -> int:
        return self._held

    def used_bytes(self) -> int:
        """Bytes held by every engine (a snapshot without the lock; `try_take` checks)."""
        return sum(slot.held for slot in self.ledger.intact_slots())

    def close(self) -> None:
        """Give everything back and leave the pool (once); the last engine removes it."""
        if self._closed:
            return
        self._closed = True
        try:
            with self.ledger.locked():
                self._leave()
        finally:
            self.ledger.close()

    # ---- the ledger ---------------------------------------------------------------------

    def _own_slot(self) -> Slot:
        return Slot(self._me.pid, self._me.started, self._held)

    def _attach(self) -> tuple[LedgerFile, int, int]:
        """Create the pool (slot 0) or join it: (its ledger, this engine's slot, its size)."""
        spec = self.spec
        for _ in range(_ATTACH_TRIES):
            if spec.size_bytes is not None:
                created = LedgerFile.create(spec.name, spec.path, spec.size_bytes, self._me)
                if created is not None:
                    return created, 0, spec.size_bytes
            ledger = LedgerFile.open_existing(spec.name, spec.path)
            if ledger is None:
                if spec.size_bytes is None:
                    raise spec.missing()
                continue  # removed between the two: create it
            try:
                joined = self._join(ledger)
            except BaseException:
                ledger.close()
                raise
            if joined is not None:
                return ledger, *joined
            ledger.close()
        raise ConfigError(f"KV memory pool {spec.name!r}: its ledger kept disappearing while joining")

    def _join(self, ledger: LedgerFile) -> tuple[int, int] | None:
        """Take a free slot: (slot, pool size), None when the ledger was removed meanwhile."""
        with ledger.locked():
            if not ledger.is_linked():
                return None
            state = ledger.read()
            if self.spec.size_bytes not in (None, state.size_bytes):
                raise ConfigError(
                    f"KV memory pool {self.spec.name!r} holds {state.size_bytes} bytes; "
                    f"this engine asked for {self.spec.size_bytes}"
                )
            state = self._check_holders(ledger, state, own=None)
            for index, slot in enumerate(state.slots):
                if slot.is_free and ledger.lock_slot(index):
                    ledger.write_slot(index, self._me)
                    return index, state.size_bytes
        raise ConfigError(f"KV memory pool {self.spec.name!r} has {NUM_SLOTS} engines attached already")

    def _checked_state(self) -> LedgerState:
        """The ledger under the lock: every byte as engines write them, this engine's slot as
        it left it, every other slot's engine alive and attached (dead ones reclaimed)."""
        state = self.ledger.read()
        if state.size_bytes != self.size_bytes:
            raise self.ledger.error(
                f"its size changed from {self.size_bytes} to {state.size_bytes}: {_OUTSIDE}"
            )
        own = state.slots[self._slot]
        if own != self._own_slot():
            raise self.ledger.error(
                f"slot {self._slot} should show this engine (pid {self._me.pid}) holding {self._held} "
                f"bytes, not pid {own.pid} holding {own.held}: {_OUTSIDE}"
            )
        return self._check_holders(self.ledger, state, own=self._slot)

    def _check_holders(self, ledger: LedgerFile, state: LedgerState, own: int | None) -> LedgerState:
        """Reclaim the slots of engines that are gone; refuse a slot of a live process that
        does not hold the slot's lock (no engine wrote it)."""
        slots = list(state.slots)
        for index, slot in enumerate(slots):
            if slot.is_free or index == own:
                continue
            if _start_time(slot.pid) != slot.started:
                logger.warning(
                    "KV memory pool %r: engine pid %d is gone, %d bytes back",
                    self.spec.name,
                    slot.pid,
                    slot.held,
                )
                ledger.write_slot(index, FREE)
                slots[index] = FREE
            elif not ledger.slot_attached(index):
                raise ledger.error(
                    f"slot {index} claims {slot.held} bytes for pid {slot.pid}, a live process "
                    f"that is not attached to the pool: {_OUTSIDE}"
                )
        return LedgerState(state.size_bytes, tuple(slots))

    def _leave(self) -> None:
        """Free this engine's slot; remove the ledger when no engine is left (under the lock,
        so an engine joining meanwhile finds the file unlinked and creates a new one)."""
        if self.ledger.read_slot(self._slot) == self._own_slot():
            self.ledger.write_slot(self._slot, FREE)
        else:
            logger.warning("KV memory pool %r: slot %d changed: %s", self.spec.name, self._slot, _OUTSIDE)
        try:
            state = self._check_holders(self.ledger, self.ledger.read(), own=None)
        except ConfigError as exc:
            logger.warning("KV memory pool %r: ledger left in place: %s", self.spec.name, exc)
            return
        if all(slot.is_free for slot in state.slots):
            self.ledger.remove()
            logger.info("KV memory pool %r: the last engine left, ledger removed", self.spec.name)


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
