"""The engine core's own process: a busy loop that never waits on the HTTP front end.

``run_core_process`` is the target of a spawned or forked child (``core_client.CoreClient``):

    connect sockets -> build the core -> send Ready (or StartupFailed and exit)
    loop: drain messages (add / abort / release_kv / stats / shutdown)
          step() while there is work, else block on the input socket
          push Outputs (with the core's latest stats) whenever something changed

The child watches its parent: when the parent dies it shuts the core down and exits
(after a grace period a watchdog thread exits it hard, even if a step hangs). SIGTERM
stops it like a shutdown message: between two steps once it serves, at once while it
loads. SIGINT is ignored (Ctrl-C reaches the whole process group: the parent decides).
A failing ``add_request`` fails that one request; a failing ``step()`` fails every
request in the core with an error output and the loop keeps serving.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Protocol

import zmq

from kvferry.config import EngineConfig
from kvferry.engine.core_protocol import (
    REQ_ABORT,
    REQ_ADD,
    REQ_RELEASE_KV,
    REQ_SHUTDOWN,
    REQ_STATS,
    CoreCodec,
    Outputs,
    Ready,
    StartupFailed,
    stats_to_wire,
)
from kvferry.errors import ConfigError
from kvferry.messages.engine_core import EngineCoreOutput, EngineCoreRequest, FinishReason
from kvferry.process_exit import leave_remaining_objects_to_the_os
from kvferry.process_name import name_this_process

logger = logging.getLogger(__name__)

CORE_PROCESS_NAME = "kvferry-core"
PARENT_DEATH_GRACE_S = 10.0  # after this, a watchdog exits the child hard
SPIN_STEP_S = 0.001  # an empty step faster than this means nothing could run ...
SPIN_WAIT_MS = 1  # ... so wait this long on the socket before the next step (no hot spin),
MAX_SPIN_WAIT_MS = 8  # doubling while steps stay empty (leases, remote KV), up to this
MAX_CONSECUTIVE_STEP_FAILURES = 10  # then the core is broken: exit (the parent reports it dead)


class CoreLike(Protocol):
    """What the loop needs from an engine core (``kvferry.engine.core.EngineCore``)."""

    def add_request(self, req: EngineCoreRequest) -> None: ...
    def abort_requests(self, req_ids: list[str]) -> None: ...
    def release_kv(self, req_ids: list[str]) -> None: ...
    def step(self) -> list[EngineCoreOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> object: ...
    def shutdown(self) -> None: ...


CoreFactory = Callable[[EngineConfig], CoreLike]


def make_engine_core(config: EngineConfig) -> CoreLike:
    """The default core factory: the real EngineCore (imported in the child only). This
    process has computed nothing yet, so TP ranks fork from it (RankStart.FORK)."""
    from kvferry.engine.core import EngineCore
    from kvferry.executor.rank_start import RankStart

    return EngineCore(config, rank_start=RankStart.FORK)


def run_core_process(
    config: EngineConfig,
    core_factory: CoreFactory,
    input_addr: str,
    output_addr: str,
    log_level: int = logging.INFO,
) -> None:
    """Entry point of the core process: build the core, serve until stopped, shut it down.
    A forked child drops what it inherited: the parent's signal wake-up fd (a signal to the
    child must not reach the parent's event loop) and its log handlers (the child's lines
    carry [core])."""
    signal.set_wakeup_fd(-1)
    name_this_process(CORE_PROCESS_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_system_exit)  # while loading: give up the load
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s [core] %(name)s: %(message)s", force=True
    )
    parent = multiprocessing.parent_process()
    parent_sentinel = parent.sentinel if parent is not None else None
    if parent_sentinel is not None:
        threading.Thread(target=_exit_when_parent_dies, args=(parent_sentinel,), daemon=True).start()
    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    out_sock = ctx.socket(zmq.PUSH)
    in_sock.connect(input_addr)
    out_sock.connect(output_addr)
    codec = CoreCodec()
    linger_ms = 1000  # let the last outputs reach the front end
    try:
        built = _build_core(core_factory, config, out_sock, codec)
        if built is None:
            return
        core, wake_fd = built
        try:
            loop = CoreLoop(core, in_sock, out_sock, codec, parent_sentinel, wake_fd)
            loop.run()
        finally:
            core.shutdown()
        if loop.orphaned:  # nobody reads the outputs, nor removes the socket files
            linger_ms = 0
            _remove_ipc_dir(input_addr)
    finally:
        in_sock.close(linger=0)
        out_sock.close(linger=linger_ms)
        ctx.term()
    logger.info("engine core process exits")
    leave_remaining_objects_to_the_os()


def _raise_system_exit(signum: int, _frame: object) -> None:
    raise SystemExit(f"{signal.Signals(signum).name} received")


def _wake_fd_on_sigterm() -> int:
    """From now on SIGTERM only makes the returned fd readable, so the loop stops between steps.

    ``signal.set_wakeup_fd`` writes the signal number to the pipe as the signal arrives,
    which wakes a poll that a flag set by a Python handler would not.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd)
    signal.signal(signal.SIGTERM, lambda *_: None)  # a Python handler routes the signal to the fd
    return read_fd


def _build_core(
    factory: CoreFactory, config: EngineConfig, out_sock: zmq.Socket[bytes], codec: CoreCodec
) -> tuple[CoreLike, int] | None:
    """The core and the fd SIGTERM wakes from now on (set before Ready is sent: a SIGTERM
    that follows Ready stops the loop between steps, never the load handler); None if the
    start-up failed (reported)."""
    try:
        core = factory(config)
        stats = stats_to_wire(core.stats())
    except BaseException as exc:  # report everything, also SystemExit/KeyboardInterrupt from a loader
        if isinstance(exc, SystemExit):
            logger.warning("engine core start-up abandoned: %s", exc)
        elif not isinstance(exc, ConfigError):  # a user's configuration: its message says it all
            logger.exception("engine core failed to start")
        msg = StartupFailed(type(exc).__name__, str(exc), traceback.format_exc())
        out_sock.send(codec.encode(msg))
        return None
    wake_fd = _wake_fd_on_sigterm()
    out_sock.send(codec.encode(Ready(stats)))
    return core, wake_fd


def _remove_ipc_dir(addr: str) -> None:
    if addr.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(addr[len("ipc://") :]), ignore_errors=True)


def _exit_when_parent_dies(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    logger.warning("parent process died; engine core exits in at most %.0f s", PARENT_DEATH_GRACE_S)
    threading.Event().wait(PARENT_DEATH_GRACE_S)
    logger.error("engine core did not exit after its parent died; exiting hard")
    os._exit(1)


class CoreLoop:
    """Drain messages, step, push outputs: until shutdown, SIGTERM or the parent dies."""

    def __init__(
        self,
        core: CoreLike,
        in_sock: zmq.Socket[bytes],
        out_sock: zmq.Socket[bytes],
        codec: CoreCodec,
        parent_sentinel: int | None = None,
        sigterm_fd: int | None = None,
    ):
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.codec = codec
        self.poller = zmq.Poller()
        self.poller.register(in_sock, zmq.POLLIN)
        self.parent_sentinel = parent_sentinel
        self.sigterm_fd = sigterm_fd
        for fd in (parent_sentinel, sigterm_fd):
            if fd is not None:
                self.poller.register(fd, zmq.POLLIN)
        self.live: set[str] = set()  # requests added and neither finished nor aborted
        self.stats_seq = 0
        self.step_failures = 0  # consecutive
        self.pending: list[EngineCoreOutput] = []  # outputs produced outside step (errors)
        self.dirty = False  # state changed since the last push (stats are stale)
        self.stopping = False
        self.orphaned = False  # the parent died

    def run(self) -> None:
        # Back off while steps find nothing to do (e.g. only waiting for remote KV): poll
        # SPIN_WAIT_MS, then twice as long each empty step, up to MAX_SPIN_WAIT_MS.
        wait_ms = 0
        while not self.stopping:
            timeout = wait_ms if self.core.has_unfinished_requests() else None
            events = dict(self.poller.poll(timeout))
            if self.parent_sentinel is not None and self.parent_sentinel in events:
                logger.warning("parent process died; shutting the engine core down")
                self.orphaned = True
                return
            if self.sigterm_fd is not None and self.sigterm_fd in events:
                logger.info("SIGTERM received; shutting the engine core down")
                return
            if self.in_sock in events:
                self._drain()
                wait_ms = 0
            if not self.stopping and self.core.has_unfinished_requests():
                start = time.perf_counter()
                outputs = self._step()
                quiet = not outputs and time.perf_counter() - start < SPIN_STEP_S
                wait_ms = min(max(2 * wait_ms, SPIN_WAIT_MS), MAX_SPIN_WAIT_MS) if quiet else 0
                self.pending.extend(outputs)
            self._push()

    def _drain(self) -> None:
        while not self.stopping:
            try:
                kind, payload = self.in_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(kind, payload)

    def _handle(self, kind: bytes, payload: bytes) -> None:
        self.dirty = True
        if kind == REQ_ADD:
            self._add(payload)
        elif kind == REQ_ABORT:
            self._abort(self.codec.decode_ids(payload))
        elif kind == REQ_RELEASE_KV:
            self._release_kv(self.codec.decode_ids(payload))
        elif kind == REQ_STATS:
            self.stats_seq = max(self.stats_seq, self.codec.decode_seq(payload))
        elif kind == REQ_SHUTDOWN:
            logger.info("shutdown requested")
            self.stopping = True
        else:
            logger.error("unknown message kind %r ignored", kind)

    def _add(self, payload: bytes) -> None:
        try:
            req = self.codec.decode_request(payload)
        except Exception:
            logger.exception("undecodable add request dropped")
            return
        try:
            self.core.add_request(req)
        except Exception as exc:
            logger.exception("add_request failed for %s", req.req_id)
            self.pending.append(_error_output(req.req_id, f"engine rejected the request: {exc}"))
            return
        self.live.add(req.req_id)

    def _abort(self, req_ids: list[str]) -> None:
        known = [r for r in req_ids if r in self.live]
        self.live.difference_update(known)
        if not known:
            return
        try:
            self.core.abort_requests(known)
        except Exception:
            logger.exception("abort_requests failed for %s", known)

    def _release_kv(self, req_ids: list[str]) -> None:
        try:
            self.core.release_kv(req_ids)
        except Exception:
            logger.exception("release_kv failed for %s", req_ids)

    def _step(self) -> list[EngineCoreOutput]:
        try:
            outputs = self.core.step()
        except Exception as exc:
            self.step_failures += 1
            logger.exception("engine step failed; failing %d requests", len(self.live))
            if self.step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise RuntimeError(f"{self.step_failures} engine steps failed in a row") from exc
            return self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
        self.step_failures = 0
        for out in outputs:
            if out.finished:
                self.live.discard(out.req_id)
        return outputs

    def _fail_all(self, message: str) -> list[EngineCoreOutput]:
        failed = sorted(self.live)
        self.live.clear()
        if failed:
            try:
                self.core.abort_requests(failed)
            except Exception:
                logger.exception("abort after a failed step failed too")
        return [_error_output(r, message) for r in failed]

    def _push(self) -> None:
        """Send pending outputs, or fresh stats after messages changed the core's state.

        Steps without outputs (prefill chunks, waiting for remote KV) send nothing: the
        front end asks for stats when it needs them (REQ_STATS).
        """
        if not self.dirty and not self.pending:
            return
        try:
            stats = stats_to_wire(self.core.stats())
        except Exception:
            logger.exception("stats() failed")
            stats = {}
        msg = Outputs(self.pending, stats, self.stats_seq)
        self.out_sock.send(self.codec.encode(msg))
        self.pending = []
        self.dirty = False


def _error_output(req_id: str, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(req_id, [], finish_reason=FinishReason.ERROR, error=message)
