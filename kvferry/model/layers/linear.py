"""Tensor-parallel linear layers.

Weights follow torch's [out, in] layout. Every parameter carries a `weight_loader(param,
full_tensor, shard_id=None)` that takes the *unsharded* checkpoint tensor and copies
this rank's slice into place, so checkpoint readers never learn about TP.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.config import WeightQuantization
from kvferry.errors import ModelLoadError
from kvferry.model.layers.gguf_kernel import GGUFBlocks, gguf_kernel_available
from kvferry.model.layers.gguf_linear import GGUFWeight
from kvferry.model.layers.int4 import Int4Weight, can_quantize_int4
from kvferry.model.layers.packed import PackedWeight, can_pack, pack
from kvferry.model.layers.parallel import TPGroup

logger = logging.getLogger(__name__)


# (parameter, the unsharded checkpoint tensor, shard id): copies this rank's slice in
WeightLoader = Callable[[nn.Parameter, torch.Tensor, object], None]
_WEIGHT_LOADER = "weight_loader"  # the attribute a parameter carries its loader in


def attach_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    """Give `param` the loader that copies this rank's slice of a checkpoint tensor in."""
    setattr(param, _WEIGHT_LOADER, loader)


def weight_loader_of(param: nn.Parameter) -> WeightLoader | None:
    """The loader `attach_weight_loader` gave `param`; None: the tensor is copied whole."""
    loader: WeightLoader | None = getattr(param, _WEIGHT_LOADER, None)
    return loader


def _param(shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ModelLoadError(f"{what}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    dst.copy_(src)


class PackableLinear(nn.Module):
    """A linear whose weight may be packed once loaded: for the CPU GEMM (layers.packed),
    or as weight-only int4 (layers.int4, --quantization int4), or as a GGUF checkpoint's
    blocks (layers.gguf_linear, --quantization gguf)."""

    weight: nn.Parameter | None  # None once packed (unless kept)
    bias: nn.Parameter | None
    packed: PackedWeight | Int4Weight | GGUFWeight | None = None

    def pack_weight(
        self,
        keep_plain: bool = False,
        quantization: WeightQuantization = WeightQuantization.NONE,
        blocks: GGUFBlocks | None = None,
    ) -> bool:
        """Pack the loaded weight; the plain one is released unless `keep_plain` (it is
        shared, e.g. a tied embedding). `blocks`: the weight as the GGUF file stores it
        (--quantization gguf). Loading weights afterwards is not supported."""
        if self.packed is not None or self.weight is None:
            return False
        self.packed = _packed_form(self.weight, quantization, blocks)
        if self.packed is None:
            return False
        if not keep_plain:
            self.register_parameter("weight", None)
        return True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.linear(x, bias)
        assert self.weight is not None, "released only once packed"
        return F.linear(x, self.weight, bias)


def _packed_form(
    weight: torch.Tensor, quantization: WeightQuantization, blocks: GGUFBlocks | None
) -> PackedWeight | Int4Weight | GGUFWeight | None:
    """int4, or the GGUF blocks, where asked and possible, else oneDNN's packed float32,
    else None."""
    if quantization is WeightQuantization.GGUF and blocks is not None and gguf_kernel_available():
        return GGUFWeight(blocks)  # no dense copy: every call runs on the blocks
    dense = pack(weight) if can_pack(weight) else None
    if quantization is WeightQuantization.INT4 and can_quantize_int4(weight):
        return Int4Weight(weight, dense if dense is not None else weight.detach())
    return dense


class ColumnParallelLinear(PackableLinear):
    """y = x W^T + b with W split by output rows; each rank returns its slice of y.

    `out_local` overrides the even split (a subclass that places its rows itself).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype | None = None,
        out_local: int | None = None,
    ):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_local = out_local if out_local is not None else tp.split(out_features, "output features")
        self.weight = _param((self.out_local, in_features), dtype)
        attach_weight_loader(self.weight, self.weight_loader)
        self.bias = _param((self.out_local,), dtype) if bias else None
        if self.bias is not None:
            attach_weight_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        rows = param.shape[0]
        copy_checked(param.data, loaded.narrow(0, self.tp.rank * rows, rows), "column-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one weight (e.g. gate and up projections).

    Shard `i` of the checkpoint holds `output_sizes[i]` rows; each rank keeps its slice of
    every shard, stacked in order.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype | None = None,
    ):
        self.output_sizes = tuple(output_sizes)
        super().__init__(in_features, sum(self.output_sizes), bias, tp, dtype)
        self.local_sizes = tuple(tp.split(n, "merged output features") for n in self.output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert isinstance(shard_id, int), "merged linear shards are numbered"
        size = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        src = loaded.narrow(0, self.tp.rank * size, size)
        copy_checked(param.data.narrow(0, offset, size), src, f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projection split by heads (see TPGroup.heads: uneven KV head counts per
    rank, query heads following their KV head; KV heads replicated when fewer than ranks)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype | None = None,
    ):
        self.head_dim = head_dim
        self.shard = tp.heads(num_heads, num_kv_heads)
        self.num_heads = self.shard.num_heads
        self.kv_head_start, self.num_kv_heads = self.shard.kv_start, self.shard.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out_total = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, out_total, bias, tp, dtype, out_local=self.q_size + 2 * self.kv_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.shard.q_start * self.head_dim
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        else:
            raise AssertionError(f"unknown qkv shard {shard_id!r}")
        src = loaded.narrow(0, start, size)
        copy_checked(param.data.narrow(0, offset, size), src, f"{shard_id} projection")

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split_with_sizes((self.q_size, self.kv_size, self.kv_size), dim=-1)
        return q, k, v


class QueryParallelLinear(ColumnParallelLinear):
    """The query projection alone, split by heads as QKVParallelLinear splits it (a layer
    that reads another layer's KV: Gemma 4's KV-shared layers)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype | None = None,
    ):
        self.head_dim = head_dim
        self.shard = tp.heads(num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads = self.shard.num_heads, self.shard.num_kv_heads
        out_local = self.num_heads * head_dim
        super().__init__(hidden_size, num_heads * head_dim, bias, tp, dtype, out_local=out_local)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        src = loaded.narrow(0, self.shard.q_start * self.head_dim, param.shape[0])
        copy_checked(param.data, src, "query projection")


class RowParallelLinear(PackableLinear):
    """y = x W^T + b with W split by input columns; partial sums are all-reduced.

    The input is this rank's slice of the features (a column-parallel output): an even
    split, or `in_range` (first feature, count) when the slices differ per rank (attention
    heads split unevenly). The bias is added once, after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype | None = None,
        in_range: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.tp = tp
        if in_range is None:
            self.in_local = tp.split(in_features, "input features")
            in_range = (tp.rank * self.in_local, self.in_local)
        self.in_start, self.in_local = in_range
        self.weight = _param((out_features, self.in_local), dtype)
        attach_weight_loader(self.weight, self.weight_loader)
        self.bias = _param((out_features,), dtype) if bias else None
        if self.bias is not None:
            attach_weight_loader(self.bias, self.bias_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        fits = loaded.dim() == 2 and loaded.shape[1] >= self.in_start + self.in_local
        src = loaded.narrow(1, self.in_start, self.in_local) if fits else loaded  # else: shape error
        copy_checked(param.data, src, "row-parallel weight")

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        copy_checked(param.data, loaded, "row-parallel bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.matmul(x, self.bias)
        out = self.tp.all_reduce(self.matmul(x))
        return out + self.bias if self.bias is not None else out
