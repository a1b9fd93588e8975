"""Front-end handle on the engine core process: start it, talk to it over ZMQ, watch it.

Sockets are ``ipc://`` files in a private temporary directory, so any number of engines
run side by side on one host. The client binds both sockets; the child connects:

    front end  PUSH --(add/abort/release_kv/stats/shutdown)--> PULL  core
    front end  PULL <--(Ready | StartupFailed | Outputs)-- PUSH core

Sends never block the event loop: the input socket has no high-water mark and a send to
a dead core raises ``EngineDeadError`` instead of waiting.

The core process is spawned (a fresh interpreter that imports torch, the model's config and
the engine itself: about 6 s of one core's time on a 2-core AVX2 EPYC) or, from a process
that has imported all that and computed nothing (the server's front end), forked
(CoreStart.FORK): the child starts with those imports done. The child is forked before
this client opens its ZMQ context, so it inherits no ZMQ state.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.context
import shutil
import tempfile
import time
from enum import Enum
from typing import Any

import zmq
import zmq.asyncio

from kvferry.config import EngineConfig
from kvferry.engine.core_proc import CoreFactory, make_engine_core, run_core_process
from kvferry.engine.core_protocol import (
    REQ_ABORT,
    REQ_ADD,
    REQ_RELEASE_KV,
    REQ_SHUTDOWN,
    REQ_STATS,
    CoreCodec,
    EngineDeadError,
    EngineStartupError,
    Outputs,
    Ready,
    StartupFailed,
)
from kvferry.engine.startup_report import process_age_s
from kvferry.messages.engine_core import EngineCoreRequest

logger = logging.getLogger(__name__)

LIVENESS_POLL_MS = 500  # how often a waiting reader checks that the core process lives
SHUTDOWN_JOIN_S = 10.0
MAX_IPC_PATH = 100  # sockaddr_un.sun_path is 108 bytes on Linux


class CoreStart(Enum):
    """How the core process starts (multiprocessing's start method)."""

    SPAWN = "spawn"  # a fresh interpreter: safe from any parent
    FORK = "fork"  # a copy of this process: only from one that ran no torch computation,
    # holds no accelerator context and no thread the child would need


def _process_context(
    start: CoreStart,
) -> multiprocessing.context.ForkContext | multiprocessing.context.SpawnContext:
    if start is CoreStart.FORK:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _private_dir() -> str:
    path = tempfile.mkdtemp(prefix="kvferry-core-")
    if len(path) + 16 > MAX_IPC_PATH:  # a long $TMPDIR: fall back to /tmp
        shutil.rmtree(path, ignore_errors=True)
        path = tempfile.mkdtemp(prefix="kvferry-core-", dir="/tmp")
    return path


class CoreClient:
    """Starts the core process; ``wait_ready`` blocks until it is ready (or raises EngineStartupError).

    With ``wait=True`` (the default) the constructor waits; ``wait=False`` lets the caller do
    other start-up work (load the tokenizer) while the core loads the model.
    """

    def __init__(
        self,
        config: EngineConfig,
        core_factory: CoreFactory = make_engine_core,
        startup_timeout_s: float = 900.0,
        wait: bool = True,
        start: CoreStart = CoreStart.SPAWN,
    ):
        self._dir = _private_dir()
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        args = (config, core_factory, input_addr, output_addr)
        kwargs = {"log_level": logging.getLogger("kvferry").getEffectiveLevel()}
        self._proc = _process_context(start).Process(
            target=run_core_process, args=args, kwargs=kwargs, name="kvferry-core"
        )
        self._proc.start()  # the child connects to addresses bound below (ZMQ retries)
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.bind(input_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.bind(output_addr)
        self._aout: zmq.asyncio.Socket | None = None
        self._codec = CoreCodec()
        self._stats_seq = 0
        self._closed = False
        self.initial_stats: dict[str, Any] | None = None
        atexit.register(self.shutdown)
        if wait:
            self.wait_ready(startup_timeout_s)

    def wait_ready(self, timeout_s: float = 900.0) -> dict[str, Any]:
        """Block until the core is ready; returns its initial stats. Shuts down on failure."""
        if self.initial_stats is None:
            try:
                self.initial_stats = self._wait_ready(timeout_s)
            except BaseException:
                self.shutdown()
                raise
            age = process_age_s()
            since = f", {age:.1f}s after this process started" if age is not None else ""
            logger.info("engine core process %d ready%s (sockets in %s)", self._proc.pid, since, self._dir)
        return self.initial_stats

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def is_alive(self) -> bool:
        return not self._closed and self._proc.is_alive()

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._out.poll(100):
                msg = self._codec.decode_message(self._out.recv())
                if isinstance(msg, Ready):
                    return msg.stats
                if isinstance(msg, StartupFailed):
                    self._proc.join(SHUTDOWN_JOIN_S)
                    raise EngineStartupError(
                        f"engine core failed to start: {msg.error_type}: {msg.message}",
                        remote_type=msg.error_type,
                        remote_traceback=msg.traceback,
                    )
                logger.warning("unexpected %s before Ready ignored", type(msg).__name__)
            if not self._proc.is_alive():
                raise EngineStartupError(
                    f"engine core process exited with code {self._proc.exitcode} during start-up (see its log)"
                )
            if time.monotonic() > deadline:
                raise EngineStartupError(f"engine core not ready after {timeout_s:.0f} s")

    # -- requests (call from one thread: the event loop's) --------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        self._send(REQ_ADD, req)

    def abort_requests(self, req_ids: list[str]) -> None:
        if req_ids:
            self._send(REQ_ABORT, list(req_ids))

    def release_kv(self, req_ids: list[str]) -> None:
        if req_ids:
            self._send(REQ_RELEASE_KV, list(req_ids))

    def request_stats(self) -> int:
        """Ask for fresh stats; the answering Outputs has ``stats_seq`` >= the returned number."""
        self._stats_seq += 1
        self._send(REQ_STATS, self._stats_seq)
        return self._stats_seq

    def _send(self, kind: bytes, body: object) -> None:
        if self._closed:
            raise EngineDeadError("the engine has been shut down")
        frames = [kind, self._codec.encode(body)]
        while True:
            try:
                self._in.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:  # no peer connected: the core is dead or not connected yet
                if not self._proc.is_alive():
                    raise EngineDeadError(self._death_message()) from None
                time.sleep(0.001)

    def _death_message(self) -> str:
        return f"engine core process died (exit code {self._proc.exitcode})"

    # -- outputs -----------------------------------------------------------------------------

    async def get_outputs(self) -> Outputs:
        """Wait for the next Outputs message; raises EngineDeadError when the core dies."""
        if self._closed:
            raise EngineDeadError("the engine has been shut down")
        if self._aout is None:
            self._aout = zmq.asyncio.Socket.from_socket(self._out)
        while True:
            if await self._aout.poll(LIVENESS_POLL_MS):
                msg = self._codec.decode_message(await self._aout.recv())
                if isinstance(msg, Outputs):
                    return msg
                logger.warning("unexpected %s from the core ignored", type(msg).__name__)
            elif not self._proc.is_alive():
                raise EngineDeadError(self._death_message())

    # -- shutdown ----------------------------------------------------------------------------

    def _ask_to_stop(self) -> None:
        """A shutdown message; SIGTERM to a core still loading, which reads no messages yet."""
        if self.initial_stats is None:
            self._proc.terminate()
            return
        try:
            self._in.send_multipart([REQ_SHUTDOWN, b""], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def shutdown(self) -> None:
        """Stop the core process (politely, then by force) and remove the socket files."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._proc.is_alive():
            self._ask_to_stop()
            self._proc.join(SHUTDOWN_JOIN_S)
        if self._proc.is_alive():
            logger.warning("engine core did not stop in %.0f s; terminating it", SHUTDOWN_JOIN_S)
            self._proc.terminate()
            self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        logger.info("engine core process stopped (exit code %s)", self._proc.exitcode)
