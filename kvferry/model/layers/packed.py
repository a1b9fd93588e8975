"""Weights pre-packed once at load time for the CPU's matmul: float32 as kvferry's tiles
(layers.float32_kernel: every call reads the weight once as contiguous streams, in an order
that makes a row's bits independent of the rows beside it), bfloat16 where the CPU computes
it natively, and float32 where the tile kernel could not be built, for oneDNN's GEMM.

Decode steps multiply few rows (one per running request) by every weight matrix. Plain
`F.linear` re-packs the weight into the BLAS's blocked layout on every call; a weight
packed once at load time skips that. For oneDNN's form, measured on a 2-core AVX2 EPYC (2
threads, GFLOP/s, SmolLM2 shapes): at 64 rows 130 vs 100-118 for the layer matrices and 130
vs 75 for the LM head, at 8 rows 2-3.5x; at 2048 rows (prefill) ~7% below plain. The
float32 tiles read a decode step's weights faster still (layers.float32_kernel). One
packed copy serves every row count, so the plain weight is released (memory stays flat).

bfloat16 where oneDNN computes it in hardware (AVX-512 BF16, AMX; kvferry.cpu_features):
the packed GEMM gives the same bits as `F.linear` on the plain weight (which oneDNN also
runs) at every row count, and saves the per-call re-pack (the step times before and after
are in docs/benchmarks.md, "bf16 decode"). A compiled decode step fuses differently around
an opaque GEMM than around a plain one, so bf16 outputs may still part from the unpacked
ones after a near-tie (one of 8 SmolLM2 prompts, at its 17th token). Without native bf16,
bfloat16 weights stay plain (oneDNN would emulate it).

In oneDNN's form, oneDNN builds (JIT-compiles) one GEMM primitive per row count and keeps it in two caches of
1,024 entries each (its own and ideep's), about 0.7 MiB resident apiece: a server that sees
every row count from 1 to 2,048 would grow by up to ~1.4 GiB per engine process (the soak's
climbing memory, docs/benchmarks.md). `onednn_linear` pads the rows up to a ladder of
`row_bucket` sizes instead: exact up to 15 rows, then 8 steps per doubling (at most 1/8
extra rows, ~70 sizes up to 2,048), so the primitives a process builds are few and made
early. Rows are independent in a GEMM: the padding rows (zeros) are computed and dropped.

A packed weight is an opaque object to torch.compile and the GEMM the
`kvferry::packed_linear` operator: a captured graph multiplies by the packed weight as
eager code does (the same numbers), and the compiler never copies the weight into the
graph as a constant.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch._library.opaque_object import MemberType, register_opaque_type
from torch._opaque_base import OpaqueBase

from kvferry.cpu_features import native_half_precision
from kvferry.model.layers.float32_kernel import float32_kernel_available, float32_matmul, tile
from kvferry.model.operators import operator

BATCH_HINT = 64  # rows oneDNN tunes the layout for; measured as good from 1 to 2048 rows
EXACT_ROWS = 15  # row counts below 16 are used as they are
STEPS_PER_DOUBLING = 8


def row_bucket(rows: int) -> int:
    """The row count oneDNN computes for `rows`: `rows` itself up to 15, above that rounded
    up to a multiple of 1/8 of its power of two (at most 12.5% more)."""
    if rows <= EXACT_ROWS:
        return rows
    step = (1 << (rows.bit_length() - 1)) // STEPS_PER_DOUBLING
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b on a oneDNN-packed `weight`, with the rows padded to `row_bucket`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    padded = row_bucket(rows)
    if padded == rows:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    flat = x.new_empty(padded, x.shape[-1])
    flat[:rows] = x.reshape(rows, x.shape[-1])
    flat[rows:].zero_()  # only the padding: the rows are written once, not zeroed first
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def can_pack(weight: torch.Tensor) -> bool:
    """CPU weights with oneDNN available, in float32, or in bfloat16 where the CPU computes
    it natively (other dtypes and devices stay plain)."""
    # torch.backends.mkldnn.is_available carries no annotations
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    return weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and native_half_precision(torch.bfloat16)
    )


class PackedForm(Enum):
    """How a packed weight is laid out, and so which matmul multiplies it."""

    FLOAT32_TILES = "float32_tiles"  # kvferry's tiles (layers.float32_kernel)
    ONEDNN = "onednn"  # oneDNN's blocked layout


def default_form(weight: torch.Tensor) -> PackedForm:
    """float32 tiles for a float32 weight where their kernel loads here, else oneDNN's."""
    if weight.dtype == torch.float32 and float32_kernel_available():
        return PackedForm.FLOAT32_TILES
    return PackedForm.ONEDNN


class PackedWeight(OpaqueBase):
    """An [out, in] weight as kvferry's float32 tiles (`tiles`), or in oneDNN's blocked
    layout (`onednn`: the opaque mkldnn tensor)."""

    def __init__(self, weight: torch.Tensor, form: PackedForm, batch_hint: int = BATCH_HINT):
        self.out_features = int(weight.shape[0])
        self.tiles: torch.Tensor | None = None
        self.onednn: torch.Tensor | None = None
        if form is PackedForm.FLOAT32_TILES:
            self.tiles = tile(weight)
        else:
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return packed_linear(x, self, bias)

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] W^T + b, eagerly (the operator's body)."""
        if self.tiles is None:
            assert self.onednn is not None, "one of the two forms is always made"
            return onednn_linear(x, self.onednn, bias)
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        out = float32_matmul(rows, self.tiles, bias, self.out_features)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def __reduce__(self) -> tuple[type, tuple[str]]:
        """For the compiler's cache key: a reference, not the weight (an mkldnn tensor does
        not pickle, which would turn the compiled-graph cache off)."""
        return str, (type(self).__qualname__,)


register_opaque_type(
    PackedWeight, typ="reference", members={"out_features": MemberType.USE_REAL, "linear": MemberType.INLINED}
)


def pack(weight: torch.Tensor, form: PackedForm | None = None, batch_hint: int = BATCH_HINT) -> PackedWeight:
    """`weight` packed in `form` (default: `default_form`)."""
    return PackedWeight(weight, form or default_form(weight), batch_hint)


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b with W packed by `pack`; x may have any leading dims, including 0 rows."""
    out: torch.Tensor = packed_linear_op(x, packed, bias, packed.out_features)
    return out


@operator("packed_linear", mutates_args=())
def packed_linear_op(
    x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return packed.multiply(x, bias)


@packed_linear_op.register_fake
def _(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
