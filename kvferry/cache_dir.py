"""Where kvferry keeps what it learns once and reuses across starts (converted tokenizers,
--capture auto's decisions, compiled programs): $KVFERRY_CACHE_DIR, else
$XDG_CACHE_HOME/kvferry, else ~/.cache/kvferry. Imports no torch."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

CACHE_ENV = "KVFERRY_CACHE_DIR"


def default_cache_dir() -> Path:
    """The cache root this process uses when no option names one."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvferry"


def write_json_atomically(path: Path, record: dict[str, Any]) -> None:
    """Write `record` to `path` through a temporary file and a rename, so that a reader (another
    instance starting) never sees half a file; OSError when it cannot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as out:
        json.dump(record, out, indent=1)
    os.replace(tmp, path)
