"""Hosts emulated on one machine: a network namespace each, joined by a bridge.

Each host gets a veth pair whose outer end is on the bridge and whose inner end (``eth0``)
has an address of its own; the bridge has ``.1``, so a process in the root namespace (a
test, a benchmark's client or proxy) reaches every host. ``shape`` gives a host's link a
rate and a delay (``tc`` netem, on what it sends). Needs root and iproute2: ``unavailable``
says why not, and the caller skips (a test) or refuses (a benchmark).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Hosts:
    """Namespaces named ``<tag><index>`` on the bridge ``<tag>br``, subnet 10.<net>.<sub>.0/24."""

    def __init__(self, tag: str, names: Sequence[str], net: int = 232) -> None:
        self.tag = tag
        self.names = list(names)
        self.subnet = f"10.{net}.{os.getpid() % 200 + 20}"
        self.bridge = f"{tag}br"

    def namespace(self, name: str) -> str:
        return f"{self.tag}{self.names.index(name)}"

    def addr(self, name: str) -> str:
        return f"{self.subnet}.{self.names.index(name) + 2}"

    def exec_prefix(self, name: str) -> list[str]:
        """Prefix a command with this to run it on host ``name``."""
        return ["ip", "netns", "exec", self.namespace(name)]

    def create(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for name in self.names:
            ns, veth = self.namespace(name), f"{self.namespace(name)}v"
            ip("netns", "add", ns)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{self.addr(name)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def shape(self, name: str, rate: str, delay: str | None = None) -> None:
        """What host ``name`` sends goes at ``rate`` (tc's units: 1gbit, 500mbit), through a
        token bucket holding 10 ms of traffic; with ``delay`` (10us, 1ms) through netem
        instead, which some kernels lack (then OSError)."""
        ns = self.namespace(name)
        if delay:
            shape = ["netem", "rate", rate, "delay", delay, "limit", "1000000"]
        else:
            burst = max(rate_bits(rate) // 8 // 100, 32 << 10)
            shape = ["tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]
        ip("netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root", *shape)

    def destroy(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", self.namespace(name)], capture_output=True, timeout=20)
            subprocess.run(["ip", "link", "del", f"{self.namespace(name)}v"], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=20)


UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}


def rate_bits(rate: str) -> int:
    """A tc rate (1gbit, 500mbit, 100kbit) in bits per second."""
    for unit, scale in UNITS.items():
        if rate.endswith(unit) and rate[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"not a tc rate: {rate!r} (e.g. 1gbit, 500mbit)")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can be tried)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2"
    return None
