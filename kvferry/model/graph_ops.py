"""The connector's per-layer hooks as operators a captured graph keeps (invariant 2).

An attention layer calls the hooks as its `HookPlacement` says:
- IN_GRAPH (graph-safe connector): `kvferry::wait_for_layer_load` before the layer's
  attention, `kvferry::save_kv_layer` after it. They are registered custom operators, so
  a compiled graph calls them on every execution; they take the step's ForwardContext
  (a graph input) and so reach the metadata bound for that step. Each is declared to
  mutate the layer's attention output buffer: that orders them around the attention
  operator (which writes the buffer) and keeps the compiler from dropping them.
- SPLIT (not graph-safe): plain Python calls the compiler may not trace
  (`torch.compiler.disable`, applied by `cut_compiled_graphs_at_split_hooks` before a
  forward is compiled): the graph is split there and the hook runs eagerly between
  compiled pieces.
- NONE: nothing is called.

On CUDA the captured program replays CUDA graphs between these operators: they are
tagged `cudagraph_unsafe` (Python that reads the step's context cannot be replayed), so
inductor partitions the graph around them. A connector whose hooks could be replayed
would have to provide them as device kernels reading static buffers; none does yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvferry.model.forward_context import ForwardContext, HookPlacement, LayerKVHooks
from kvferry.model.operators import operator


def _hooks(ctx: ForwardContext, layer_name: str) -> LayerKVHooks:
    if ctx.kv_hooks is None:
        raise RuntimeError(f"{layer_name} calls the connector's hooks, but the step has none")
    return ctx.kv_hooks


def _wait(ctx: ForwardContext, layer_name: str) -> None:
    _hooks(ctx, layer_name).wait_for_layer_load(layer_name)


def _save(ctx: ForwardContext, layer_name: str) -> None:
    hooks = _hooks(ctx, layer_name)
    hooks.save_kv_layer(layer_name, ctx.kv_caches[layer_name], ctx.attn_for(layer_name))


@operator("wait_for_layer_load", mutates_args=("order",), tags=(torch.Tag.cudagraph_unsafe,))
def wait_for_layer_load_op(order: torch.Tensor, ctx: ForwardContext, layer_name: str) -> None:
    """The connector's wait_for_layer_load; `order` is the layer's attention output buffer."""
    _wait(ctx, layer_name)


@operator("save_kv_layer", mutates_args=("order",), tags=(torch.Tag.cudagraph_unsafe,))
def save_kv_layer_op(order: torch.Tensor, ctx: ForwardContext, layer_name: str) -> None:
    """The connector's save_kv_layer once the layer's KV is written (`order`: as above)."""
    _save(ctx, layer_name)


@wait_for_layer_load_op.register_fake
@save_kv_layer_op.register_fake
def _(order: torch.Tensor, ctx: ForwardContext, layer_name: str) -> None:
    return None


@dataclass
class _SplitCalls:
    """SPLIT's hooks as called from a forward: plain calls until a compiler is to trace one
    (`cut_compiled_graphs_at_split_hooks`)."""

    wait: Callable[[ForwardContext, str], None] = _wait
    save: Callable[[ForwardContext, str], None] = _save


_SPLIT_CALLS = _SplitCalls()


def cut_compiled_graphs_at_split_hooks() -> None:
    """Make SPLIT's hooks calls the compiler may not trace (`torch.compiler.disable`), so a
    compiled graph is cut at each and the hook runs eagerly. Called before a forward is
    compiled, not at import: importing the compiler takes seconds, which a process that
    never compiles (an eager engine, every front end) would pay. Idempotent; an eager
    forward calls the same hooks either way."""
    if _SPLIT_CALLS.wait is _wait:  # torch.compiler.disable carries no annotations
        _SPLIT_CALLS.wait = torch.compiler.disable(_wait)  # type: ignore[no-untyped-call]
        _SPLIT_CALLS.save = torch.compiler.disable(_save)  # type: ignore[no-untyped-call]


def before_attention(
    placement: HookPlacement, out: torch.Tensor, ctx: ForwardContext, layer_name: str
) -> None:
    if placement is HookPlacement.IN_GRAPH:
        torch.ops.kvferry.wait_for_layer_load(out, ctx, layer_name)
    elif placement is HookPlacement.SPLIT:
        _SPLIT_CALLS.wait(ctx, layer_name)


def after_attention(
    placement: HookPlacement, out: torch.Tensor, ctx: ForwardContext, layer_name: str
) -> None:
    if placement is HookPlacement.IN_GRAPH:
        torch.ops.kvferry.save_kv_layer(out, ctx, layer_name)
    elif placement is HookPlacement.SPLIT:
        _SPLIT_CALLS.save(ctx, layer_name)
