"""What the weight-only quantized linears share: a compiler cache key that names the type
rather than hashing the weight (int4, GGUF blocks), and the dense weight kept for calls with
more rows than the kernel is fast for (int4)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._opaque_base import OpaqueBase

from kvferry.model.layers.packed import PackedWeight


class KeyedByType(OpaqueBase):
    """A weight the compiler sees as an opaque reference: its cache key names the type
    rather than hashing the weight."""

    def __reduce__(self) -> tuple[type, tuple[str]]:
        """For the compiler's cache key: a reference, not the weight."""
        return str, (type(self).__qualname__,)


class DenseFallbackWeight(KeyedByType):
    """A quantized [out, in] weight with its dense form (`dense`) for large calls."""

    dense: PackedWeight | torch.Tensor
    max_rows: int  # calls with more rows use `dense`

    def dense_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if isinstance(self.dense, PackedWeight):
            return self.dense.multiply(rows, None)
        return F.linear(rows, self.dense)


def quantized_linear(
    x: torch.Tensor,
    weight: DenseFallbackWeight,
    bias: torch.Tensor | None,
    out_features: int,
    kernel: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """x [..., in] times `weight`: `kernel` on the rows (of x's dtype) for calls of up to
    `weight.max_rows` rows, the dense weight above. A decode step makes ~120 such calls
    with x [rows, in]: no reshape is dispatched that would change nothing (each costs an
    operator call, ~1 us)."""
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        out = x.new_empty(0, out_features)
    elif rows.shape[0] > weight.max_rows:
        out = weight.dense_matmul(rows)
    else:
        out = kernel(rows)
    if not flat:
        out = out.reshape(*x.shape[:-1], out_features)
    return out if bias is None else out + bias
