"""Listening ports chosen ahead of their bind, without racing the kernel's outgoing ports.

A port found free by binding port 0 comes from the kernel's ephemeral range: the range it
also hands to every outgoing connection. Between choosing such a port and binding it for
real (an engine binds its side channel only after loading its model, seconds later) any
connection on the host, a health poll included, can take it, and the bind fails with
"Address already in use". Ports are therefore chosen below that range, where the kernel
never assigns one on its own, at random, checked bindable, and never twice by one picker;
a process forked from another picks from a sequence of its own.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000  # below: well-known and registered services
ATTEMPTS = 200


def ephemeral_start(range_file: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The first port the kernel may assign to an outgoing connection (IANA's 49152 elsewhere)."""
    try:
        return int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


class PortPicker:
    """Chooses listening ports outside the ephemeral range; remembers what it handed out."""

    def __init__(self, range_file: Path = EPHEMERAL_RANGE_FILE, seed: int | None = None) -> None:
        self.stop = ephemeral_start(range_file)
        self.random = random.Random(seed)
        self.issued: set[int] = set()

    def pick(self, host: str = "127.0.0.1") -> int:
        if self.stop - LOWEST_PORT < 2 * ATTEMPTS:  # an unusual range: let the kernel choose
            return self._kernel_choice(host)
        for _ in range(ATTEMPTS):
            port = self.random.randrange(LOWEST_PORT, self.stop)
            if port not in self.issued and bindable(host, port):
                self.issued.add(port)
                return port
        raise OSError(f"no free port in [{LOWEST_PORT}, {self.stop}) on {host}")

    def _kernel_choice(self, host: str) -> int:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port: int = sock.getsockname()[1]
        self.issued.add(port)
        return port

    def reserve(self, port: int) -> None:
        """`port` is this process's to bind later (a port given on its command line): never
        handed out, though it is bindable until then."""
        self.issued.add(port)

    def start_anew_after_fork(self) -> None:
        """A forked child picks from a random sequence of its own (the parent's would give it
        the parent's next ports, and every sibling forked from the same point the same ones);
        it keeps avoiding the ports its parent issued."""
        self.random.seed()


# One picker per process, so that servers started together by one process never share a port.
PORTS = PortPicker()
os.register_at_fork(after_in_child=PORTS.start_anew_after_fork)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, that no outgoing connection will take before it is bound."""
    return PORTS.pick(host)


def reserve_port(port: int) -> None:
    """Keep `free_port` from handing out `port`, which this process binds later."""
    PORTS.reserve(port)
