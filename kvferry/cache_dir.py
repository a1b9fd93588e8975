"""Where kvferry keeps what it learns once and reuses across starts (converted tokenizers,
--capture auto's decisions, compiled programs): $KVFERRY_CACHE_DIR, else
$XDG_CACHE_HOME/kvferry, else ~/.cache/kvferry. Imports no torch."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "KVFERRY_CACHE_DIR"


def default_cache_dir() -> Path:
    """The cache root this process uses when no option names one."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvferry"
