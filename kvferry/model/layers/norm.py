"""RMSNorm, with an optional fused residual add; Gemma's (offset + w) RMSNorm; an unscaled one."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.model.layers.linear import attach_weight_loader, copy_checked

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """y = weight * x / rms(x), computed in float32 like the reference, cast back to x's dtype.

    With `residual`, first x = x + residual, and return (norm(x), x): the caller carries the
    un-normalized sum as the next residual.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: y = x / rms(x) * (offset + w), in float32, cast back to x's dtype.

    The checkpoint stores w; the parameter holds offset + w in float32 (added at load, as
    the reference adds it in float32 on every call). Gemma 1-3 store w around 0 (offset 1);
    Gemma 4 stores the scale itself (offset 0).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 1.0):
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32), requires_grad=False)
        attach_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        copy_checked(param.data, self.weight_offset + loaded.float(), "Gemma RMSNorm weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps)
        return normed.to(x.dtype)


class UnscaledRMSNorm(nn.Module):
    """y = x / rms(x) in float32, cast back to x's dtype; no weight (Gemma 4's value norm)."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
