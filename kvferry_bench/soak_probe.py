"""What ``kvferry bench soak`` reads from a running deployment: its instances (from the
proxy's /metrics), the KV blocks they still hold, and the resident memory of its
processes (from /proc)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import httpx

INSTANCE_LABEL = re.compile(r'^kvferry_proxy:instance_healthy\{[^}]*instance="([^"]+)"')
PAGE = os.sysconf("SC_PAGE_SIZE")


def instance_urls(proxy_url: str) -> list[str]:
    """Every instance behind the proxy (prefill and decode)."""
    text = httpx.get(proxy_url + "/metrics", timeout=10).text
    return sorted({m.group(1) for line in text.splitlines() if (m := INSTANCE_LABEL.match(line))})


def _blocks(url: str) -> tuple[float, float]:
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in ("num_blocks", "num_free_blocks"):
            if line.startswith(f"kvferry:{name}") and line[len(f"kvferry:{name}")] in " {":
                values[name] = values.get(name, 0.0) + float(line.rpartition(" ")[2])
    return values["num_blocks"], values["num_free_blocks"]


def held_blocks(urls: list[str], settle_s: float = 30.0) -> dict[str, int]:
    """KV blocks not free on each instance, once all are free or ``settle_s`` passed
    (releases and lease expiries may lag the last answer)."""
    deadline = time.monotonic() + settle_s
    while True:
        held = {}
        for url in urls:
            total, free = _blocks(url)
            held[url] = int(total - free)
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        tree.setdefault(parent, []).append(int(entry.name))
    return tree


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0  # gone meanwhile


def _descendants(pid: int, tree: dict[int, list[int]]) -> list[int]:
    """Every process under ``pid`` in ``tree`` (not ``pid`` itself)."""
    found, todo = [], list(tree.get(pid, []))
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(tree.get(current, []))
    return found


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (0 for those gone meanwhile)."""
    return sum(_rss(current) for current in [pid, *_descendants(pid, _children())])


def _role(pid: int) -> str:
    """What a process of ``kvferry disagg`` is, from its command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"pid {pid}"
    text = b" ".join(argv).decode(errors="replace")
    for word, role in (("proxy", "proxy"), ('"producer"', "prefill"), ('"consumer"', "decode")):
        if word in text:
            return f"{role} {pid}"
    return f"pid {pid}"


def rss_by_child(pid: int) -> dict[str, int]:
    """Resident bytes of ``pid`` ("launcher") and of every process under each of its
    children (an instance: API server, then its engine core and workers), named by the
    instance's role: "prefill 12", "prefill 12 > 15", ..."""
    tree = _children()
    out = {"launcher": _rss(pid)}
    for child in tree.get(pid, []):
        role = _role(child)
        out[role] = _rss(child)
        for current in _descendants(child, tree):
            out[f"{role} > {current}"] = _rss(current)
    return out


def kv_resident(urls: list[str]) -> int:
    """KV memory committed on all the instances (/metrics' kv_resident_bytes)."""
    total = 0.0
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("kvferry:kv_resident_bytes"):
                total += float(line.rpartition(" ")[2])
    return int(total)
