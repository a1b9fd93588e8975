"""kvferry's operators are registered with one Python kernel each (kvferry.model.operators):
no Python autograd kernel in front of it, as `torch.library.custom_op` would add (~10 us
more per call, ~150 calls per decode step)."""

from __future__ import annotations

import pytest
import torch

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
