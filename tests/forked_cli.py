"""`kvferry` command lines for the end-to-end tests, forked from a process that has already
imported what they import. No tests here.

Each `python -m kvferry.entrypoints.cli serve ...` spends 5-7 s of one core importing torch,
transformers and the HTTP stack before it reads its arguments (docs/testing.md), and most
end-to-end tests start several. Here multiprocessing's forkserver
imports those modules once per test run, and each command is a fork of it running the
program's own `cli.main` in its own process, session (process group), environment,
working directory and log: it forks its engine core, starts its TP ranks and, under
`kvferry disagg`, its instances, as the program does. What a fork skips is the interpreter
start and `python -m`; tests that are about the command itself run it as a command
(kvferry disagg's instances, test_server_shutdown, test_disagg_restart, the network-namespace
tests, test_tp_launch, the CPU-kernel builds; docs/testing.md).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import signal
import subprocess
import sys
from pathlib import Path

# Imported once by the forkserver: the front end of `kvferry serve` (server, engine client,
# config and tokenizer), the proxy and the launcher. No torch op runs there, so no thread
# pool exists yet when a command forks (the front end forks its core the same way).
PRELOAD = [
    "kvferry.entrypoints.cli",
    "kvferry.entrypoints.openai.server",
    "kvferry.entrypoints.proxy.main",
    "kvferry.entrypoints.proxy.app",
    "kvferry.entrypoints.disagg",
    "kvferry.engine.core_client",
    "kvferry.engine.core_proc",
    "kvferry.engine.llm",
    "kvferry.model.tokenizer",
    "kvferry.model.resolve",
    "transformers",
]


def _context() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


_CONTEXT = _context()


class ForkedCommand:
    """A forked `kvferry` command, with the part of subprocess.Popen's interface the tests use."""

    def __init__(self, args: list[str], process: multiprocessing.context.ForkServerProcess):
        self.args = args
        self._process = process
        self.pid: int = process.pid or 0

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# What the tests hold of a running command: forked here, or started by subprocess.
Command = ForkedCommand | subprocess.Popen


def start(args: list[str], log: Path, env: dict[str, str], cwd: Path) -> ForkedCommand:
    """`kvferry ARGS` in a new session, stdout and stderr to `log` (as Popen with
    start_new_session=True and both streams to one file)."""
    log.write_bytes(b"")  # there when this returns, as Popen's output file is
    process = _CONTEXT.Process(target=_run, args=(args, str(log), env, str(cwd)), name="kvferry")
    process.start()
    return ForkedCommand(args, process)


def kill_leftovers() -> None:
    """SIGKILL every child process still running at the end of a test run, with its process
    group where it leads one (a command): multiprocessing waits for its children when the
    interpreter exits."""
    for process in multiprocessing.active_children():
        if process.pid is None:
            continue
        for kill in (os.killpg, os.kill):
            try:
                kill(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        process.join(10)


def _run(args: list[str], log: str, env: dict[str, str], cwd: str) -> None:
    """In the fork: what `python -m kvferry.entrypoints.cli ARGS` would be after its imports."""
    os.setsid()
    out = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    from kvferry.entrypoints import cli

    sys.argv = [cli.__file__, *args]
    cli.main(args)
