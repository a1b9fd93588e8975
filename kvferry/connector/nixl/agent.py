"""A thin owner of one NIXL agent, over NIXL's bindings: registration, remote agents, READs.

Progress (UCX moves a READ's bytes only while someone progresses its worker, on the
passive side too over TCP):

- ``progress_thread=True`` (the default): NIXL's UCX progress thread, told to sleep in
  ``poll`` on the worker's event descriptors, with a 10 ms tick as a safety net. It wakes
  when bytes or requests arrive and costs nothing between them; the interpreter is not
  involved. (NIXL's Python wrapper starts that thread with no sleep at all, a busy loop
  on a core; its bindings take the delay, so the agent is built from them directly.)
- ``progress_thread=False``: no thread; whoever owns the agent calls ``progress()``
  often while anything is in flight, or transfers hang.

Not thread-safe: one thread uses it after registration.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from kvferry.connector.nixl.plan import ReadPlan
from kvferry.connector.nixl.regions import Region
from kvferry.errors import KVFerryError

logger = logging.getLogger(__name__)

PROGRESS_TICK_US = 10_000  # the progress thread's safety tick (it sleeps on UCX's events otherwise)


class NixlError(KVFerryError, RuntimeError):
    """NIXL refused an operation (registration, metadata, transfer)."""


class TransferState(str, enum.Enum):
    """A READ's state, as NIXL spells it (str-valued: equal to NIXL's strings)."""

    PROC = "PROC"  # in flight
    DONE = "DONE"
    ERR = "ERR"


@dataclass
class Transfer:
    handle: object
    num_bytes: int
    num_descriptors: int
    state: TransferState


def _bindings() -> Any:
    try:
        from nixl import _bindings
    except ImportError as exc:  # pragma: no cover - nixl is a dependency
        raise NixlError(f"nixl is not installed: {exc}") from exc
    return _bindings


class Agent:
    def __init__(self, name: str, device: str = "cpu", progress_thread: bool = True):
        nixl = _bindings()
        config = nixl.nixlAgentConfig()
        config.useProgThread = progress_thread
        config.useListenThread = False
        config.pthrDelay = PROGRESS_TICK_US
        config.syncMode = nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE  # one caller thread
        self._nixl = nixl
        self.name = name
        self.progress_thread = progress_thread
        self._mem = nixl.VRAM_SEG if device.startswith("cuda") else nixl.DRAM_SEG
        try:
            self._agent = nixl.nixlAgent(name, config)
            self._agent.createBackend("UCX", {})
        except Exception as exc:
            raise NixlError(f"NIXL could not start agent {name} with UCX: {exc}") from exc
        self._registered: list[object] = []
        self._remotes: dict[bytes, str] = {}  # metadata -> agent name

    def register(self, regions: list[Region]) -> None:
        """Register each region once (the caller deduplicated them by base address)."""
        descs = [(r.base, r.size, r.device_id, "") for r in regions]
        try:
            reg = self._nixl.nixlRegDList(self._mem, descs)
            status = self._agent.registerMem(reg, [])
        except Exception as exc:
            status = exc
        if status != self._nixl.NIXL_SUCCESS:
            raise NixlError(f"NIXL could not register {len(regions)} KV regions: {status}")
        self._registered.append(reg)

    def metadata(self) -> bytes:
        metadata: bytes = self._agent.getLocalMD()
        return metadata

    def add_remote(self, metadata: bytes) -> str:
        """Load a remote agent's metadata once; its name."""
        name = self._remotes.get(metadata)
        if name is None:
            try:
                loaded = self._agent.loadRemoteMD(metadata)
            except Exception as exc:
                raise NixlError(f"NIXL could not load a remote agent: {exc}") from exc
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            self._remotes[metadata] = name
            try:
                self._agent.makeConnection(name, [])  # connect now, not in the first READ
            except Exception as exc:
                logger.warning("NIXL could not pre-connect to %s: %s", name, exc)
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a remote agent (and disconnect from it): in-flight transfers to it stop."""
        for metadata, known in list(self._remotes.items()):
            if known == name:
                del self._remotes[metadata]
        try:
            self._agent.invalidateRemoteMD(name)
        except Exception as exc:
            logger.warning("NIXL could not remove remote agent %s: %s", name, exc)

    def read(self, plan: ReadPlan, remote_agent: str) -> Transfer:
        """Start a READ of plan.remote into plan.local."""
        nixl = self._nixl
        try:
            local = nixl.nixlXferDList(self._mem, plan.local)
            remote = nixl.nixlXferDList(self._mem, plan.remote)
            handle = self._agent.createXferReq(nixl.NIXL_READ, local, remote, remote_agent, "", [])
        except Exception as exc:
            raise NixlError(f"NIXL READ from {remote_agent} could not start: {exc}") from exc
        try:
            state = self._state(self._agent.postXferReq(handle, ""))
        except Exception as exc:
            self._agent.releaseXferReq(handle)
            raise NixlError(f"NIXL READ from {remote_agent} could not start: {exc}") from exc
        return Transfer(handle, plan.num_bytes, plan.num_descriptors, state)

    def _state(self, status: object) -> TransferState:
        if status == self._nixl.NIXL_SUCCESS:
            return TransferState.DONE
        if status == self._nixl.NIXL_IN_PROG:
            return TransferState.PROC
        return TransferState.ERR

    def poll(self, transfer: Transfer) -> TransferState:
        if transfer.state is TransferState.PROC:
            try:
                transfer.state = self._state(self._agent.getXferStatus(transfer.handle))
            except Exception as exc:
                logger.warning("NIXL transfer state check failed: %s", exc)
                transfer.state = TransferState.ERR
        return transfer.state

    def release(self, transfer: Transfer) -> bool:
        """Release a transfer's handle; False when NIXL refuses (it may still be running)."""
        try:
            status = self._agent.releaseXferReq(transfer.handle)
        except Exception as exc:
            status = exc
        if status != self._nixl.NIXL_SUCCESS:
            logger.warning("NIXL refused to release a transfer (%s): %s", transfer.state, status)
            return False
        return True

    def progress(self) -> None:
        """Drive the backend where no progress thread does (notifications are unused)."""
        if self.progress_thread:
            return
        try:
            self._agent.getNotifs({}, [])
        except Exception as exc:
            logger.warning("NIXL progress failed: %s", exc)

    def close(self) -> None:
        for reg in self._registered:
            try:
                self._agent.deregisterMem(reg, [])
            except Exception as exc:
                logger.warning("NIXL deregistration failed: %s", exc)
        self._registered.clear()
