"""What every benchmark result records about the host, and how it is written."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from kvferry.cpu_features import host_cpu_features, isa_cap


def host_facts() -> dict:
    """The torch thread count and the CPU the numbers were taken on (with its flags, and the
    level $KVFERRY_MAX_ISA held kvferry to, if any)."""
    import torch

    cap = isa_cap()
    return {
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "cpu": host_cpu_features().summary(),
        "isa_cap": cap.value if cap else None,
    }


def save_json(doc: dict, output: str | Path) -> Path:
    """Write `doc` to `output` (parents created); the path."""
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    return path
