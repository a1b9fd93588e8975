"""Hosts emulated on one machine: a network namespace each, joined by a bridge.

No tests here. Each host gets a veth pair whose outer end is on the bridge and whose inner
end (``eth0``) has an address of its own; the bridge has ``.1``, so the test process (in
the root namespace) reaches every host. Needs root and iproute2: ``available`` says why
not, and the caller skips.
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

    def destroy(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", self.namespace(name)], capture_output=True, timeout=20)
            subprocess.run(["ip", "link", "del", f"{self.namespace(name)}v"], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=20)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can be tried)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2"
    return None
