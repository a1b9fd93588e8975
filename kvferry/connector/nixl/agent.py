"""A thin owner of one NIXL agent: registration, remote agents, READs.

Agents run without NIXL's progress thread (it busy-polls a core): whoever owns the agent
must call `progress()` often while anything is in flight, also on the passive (prefill)
side, or transfers hang. Not thread-safe: one thread uses it after registration.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from kvferry.connector.nixl.plan import ReadPlan
from kvferry.connector.nixl.regions import Region
from kvferry.errors import KVFerryError

logger = logging.getLogger(__name__)


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


class Agent:
    def __init__(self, name: str, device: str = "cpu"):
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:  # pragma: no cover - nixl is a dependency
            raise NixlError(f"nixl is not installed: {exc}") from exc
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        self.name = name
        self.mem_type = "VRAM" if device.startswith("cuda") else "DRAM"
        self._agent = nixl_agent(name, config)
        self._registered: list[object] = []
        self._remotes: dict[bytes, str] = {}  # metadata -> agent name

    def register(self, regions: list[Region]) -> None:
        """Register each region once (the caller deduplicated them by base address)."""
        descs = [(r.base, r.size, r.device_id, "") for r in regions]
        try:
            self._registered.append(self._agent.register_memory(descs, self.mem_type))
        except Exception as exc:
            raise NixlError(f"NIXL could not register {len(regions)} KV regions: {exc}") from exc

    def metadata(self) -> bytes:
        metadata: bytes = self._agent.get_agent_metadata()
        return metadata

    def add_remote(self, metadata: bytes) -> str:
        """Load a remote agent's metadata once; its name."""
        name = self._remotes.get(metadata)
        if name is None:
            try:
                name = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise NixlError(f"NIXL could not load a remote agent: {exc}") from exc
            name = name.decode() if isinstance(name, bytes) else name
            self._remotes[metadata] = name
            try:
                self._agent.make_connection(name)  # connect now, not in the first READ
            except Exception as exc:
                logger.warning("NIXL could not pre-connect to %s: %s", name, exc)
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a remote agent (and disconnect from it): in-flight transfers to it stop."""
        for metadata, known in list(self._remotes.items()):
            if known == name:
                del self._remotes[metadata]
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            logger.warning("NIXL could not remove remote agent %s: %s", name, exc)

    def read(self, plan: ReadPlan, remote_agent: str) -> Transfer:
        """Start a READ of plan.remote into plan.local."""
        try:
            local = self._agent.get_xfer_descs(plan.local, self.mem_type)
            remote = self._agent.get_xfer_descs(plan.remote, self.mem_type)
            handle = self._agent.initialize_xfer("READ", local, remote, remote_agent)
            state = TransferState(self._agent.transfer(handle))
        except Exception as exc:
            raise NixlError(f"NIXL READ from {remote_agent} could not start: {exc}") from exc
        return Transfer(handle, plan.num_bytes, plan.num_descriptors, state)

    def poll(self, transfer: Transfer) -> TransferState:
        if transfer.state is TransferState.PROC:
            try:
                transfer.state = TransferState(self._agent.check_xfer_state(transfer.handle))
            except Exception as exc:
                logger.warning("NIXL transfer state check failed: %s", exc)
                transfer.state = TransferState.ERR
        return transfer.state

    def release(self, transfer: Transfer) -> bool:
        """Release a transfer's handle; False when NIXL refuses (it may still be running)."""
        try:
            self._agent.release_xfer_handle(transfer.handle)
        except Exception as exc:
            logger.warning("NIXL refused to release a transfer (%s): %s", transfer.state, exc)
            return False
        return True

    def progress(self) -> None:
        """Drive the backend (the passive side of READs needs it); notifications are unused."""
        try:
            self._agent.get_new_notifs()
        except Exception as exc:
            logger.warning("NIXL progress failed: %s", exc)

    def close(self) -> None:
        for descs in self._registered:
            try:
                self._agent.deregister_memory(descs)
            except Exception as exc:
                logger.warning("NIXL deregistration failed: %s", exc)
        self._registered.clear()
