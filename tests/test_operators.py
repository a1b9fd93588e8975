"""kvferry's operators are registered with one Python kernel each (kvferry.model.operators):
no Python autograd kernel in front of it, as `torch.library.custom_op` would add (~10 us
more per call, ~150 calls per decode step)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvferry.model.graph_ops
import kvferry.model.layers.attention
import kvferry.model.layers.int4  # noqa: F401 - registers kvferry::int4_linear (and packed_linear)

OPERATORS = ("packed_linear", "int4_linear", "paged_attention", "wait_for_layer_load", "save_kv_layer")
KEYS = ("Autograd", "AutogradCPU", "CompositeExplicitAutograd", "CPU", "Meta")


@pytest.mark.parametrize("name", OPERATORS)
def test_an_operator_has_its_kernel_and_no_python_autograd_layer(name: str) -> None:
    qualname = f"kvferry::{name}"
    kernels = [key for key in KEYS if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)]
    assert kernels == ["CompositeExplicitAutograd", "Meta"], kernels  # Meta: the fake kernel


def test_an_operator_computes_through_torch_ops() -> None:
    from kvferry.model.layers.packed import pack, packed_linear

    weight, x = torch.randn(5, 3), torch.randn(4, 3)
    torch.testing.assert_close(packed_linear(x, pack(weight)), x @ weight.T)


class _RecordedOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_an_eager_call_runs_the_kernel_without_the_dispatcher() -> None:
    from kvferry.model.layers.packed import pack, packed_linear

    weight, x = torch.randn(5, 3), torch.randn(4, 3)
    packed = pack(weight)
    with _RecordedOps() as recorded:
        packed_linear(x, packed)
    assert recorded.names and not [name for name in recorded.names if name.startswith("kvferry.")]


def test_a_compiled_call_is_one_operator_in_the_graph() -> None:
    from kvferry.model.layers.packed import pack, packed_linear

    weight, x = torch.randn(5, 3), torch.randn(4, 3)
    packed = pack(weight)
    graphs: list[torch.fx.GraphModule] = []

    def keep_graph(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    compiled = torch.compile(lambda t: packed_linear(t, packed), backend=keep_graph, fullgraph=True)
    torch.testing.assert_close(compiled(x), x @ weight.T)
    (graph,) = graphs
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert targets == [torch.ops.kvferry.packed_linear.default]
