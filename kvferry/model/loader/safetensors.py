"""Read safetensors checkpoints (single file or sharded with an index json)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from kvferry.errors import ModelLoadError

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's .safetensors files: those the index names, else every one in the dir."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as err:
            raise ModelLoadError(f"bad safetensors index {str(index)!r}: {err}") from err
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {str(model_dir)!r}")
    for path in files:
        if not path.is_file():
            raise ModelLoadError(f"checkpoint shard {str(path)!r} is missing")
    return files


def safetensors_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of the checkpoint in `model_dir`, file by file."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        logger.debug("reading %s", path)
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
