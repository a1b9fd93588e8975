"""How MultiprocExecutor starts a tensor-parallel rank's process.

SUBPROCESS runs `python -m kvferry.executor.rank_process` (see there why not
multiprocessing's spawn): safe from any caller, and each rank imports torch and the engine
anew (about 6 s of one core's time on a 2-core AVX2 EPYC). FORK copies the executor's
process, imports done: only from a process that has run no torch computation and holds no
accelerator context, which the engine core process is while it builds its executor
(`kvferry serve`, `core_proc.make_engine_core`).

A forked rank closes every executor-side connection it inherited (so each rank still sees
EOF when the executor goes away), restores the default signal handling, names itself
kvferry-rankN and leaves with os._exit (its parent's exit handlers are not its own).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from enum import Enum
from multiprocessing.connection import Connection
from typing import Protocol

from kvferry.process_name import name_this_process

WAIT_POLL_S = 0.01


class RankStart(Enum):
    SUBPROCESS = "subprocess"
    FORK = "fork"


class RankProcess(Protocol):
    """What the executor needs of a rank's process (subprocess.Popen has it)."""

    @property
    def pid(self) -> int: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def kill(self) -> None: ...


def rank_environment() -> dict[str, str]:
    """The caller's environment, with its import path: a rank imports kvferry (and any
    out-of-tree connector) from where the caller did."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def start_rank(how: RankStart, rank: int, inherited: Sequence[Connection]) -> tuple[RankProcess, Connection]:
    """A rank's process and the executor's end of its socket pair; `inherited` are the
    executor's connections to the ranks started before (a forked rank closes them)."""
    ours, theirs = socket.socketpair()
    if how is RankStart.FORK:
        return _fork_rank(rank, ours, theirs, inherited), Connection(ours.detach())
    with theirs:
        fd = theirs.fileno()
        cmd = [sys.executable, "-m", "kvferry.executor.rank_process", "--fd", str(fd)]
        proc = subprocess.Popen(cmd, pass_fds=(fd,), env=rank_environment())
    return proc, Connection(ours.detach())


def _fork_rank(
    rank: int, ours: socket.socket, theirs: socket.socket, inherited: Sequence[Connection]
) -> ForkedRank:
    pid = os.fork()
    if pid == 0:  # the rank
        code = 1
        try:
            ours.close()
            for conn in inherited:
                conn.close()
            _reset_signals()
            name_this_process(f"kvferry-rank{rank}")
            from kvferry.executor.rank_process import run_rank

            with Connection(theirs.detach()) as conn:
                run_rank(conn)
            code = 0
        finally:
            os._exit(code)
    theirs.close()
    return ForkedRank(pid)


def _reset_signals() -> None:
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


class ForkedRank:
    """A forked rank's process, with the part of subprocess.Popen's interface the executor uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
            time.sleep(WAIT_POLL_S)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
