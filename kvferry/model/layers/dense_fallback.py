"""What the weight-only quantized linears (int4, GGUF blocks) share: the dense weight kept
for calls with more rows than their kernel is fast for, and a compiler cache key that names
the type rather than hashing the weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._opaque_base import OpaqueBase

from kvferry.model.layers.packed import PackedWeight, onednn_linear


class DenseFallbackWeight(OpaqueBase):
    """A quantized [out, in] weight with its dense form (`dense`) for large calls."""

    dense: PackedWeight | torch.Tensor

    def dense_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if isinstance(self.dense, PackedWeight):
            return onednn_linear(rows, self.dense.tensor, None)
        return F.linear(rows, self.dense)

    def __reduce__(self) -> tuple[type, tuple[str]]:
        """For the compiler's cache key: a reference, not the weight."""
        return str, (type(self).__qualname__,)
