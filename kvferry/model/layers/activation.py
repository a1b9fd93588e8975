"""Gated activations."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of last dim 2d (the merged gate_up output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
