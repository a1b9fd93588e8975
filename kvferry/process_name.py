"""The name ps and top show for a process of kvferry's own (Linux: /proc/self/comm)."""

from __future__ import annotations

from pathlib import Path

MAX_NAME = 15  # the kernel keeps 15 characters


def name_this_process(name: str) -> None:
    """A forked child's command line is its parent's: its name tells them apart."""
    try:
        Path("/proc/self/comm").write_text(name[:MAX_NAME])
    except OSError:
        pass
