"""kvferry's operators: registered with torch's dispatcher directly.

`torch.library.custom_op` wraps a Python function in two Python layers per call (an
autograd kernel, then the implementation), several times the cost of a function
registered as the operator's only kernel (docs/benchmarks.md, "bf16 decode"). A decode
step calls one operator per linear and per attention layer (~150 for SmolLM2), eagerly and
from a compiled graph alike, so kvferry registers its operators this way: the schema
inferred from the function's annotations (as `custom_op` does), the function as the CompositeExplicitAutograd
kernel (kvferry's forwards never need gradients), a fake kernel for the compiler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch._library.infer_schema import infer_schema

NAMESPACE = "kvferry"
# The namespace's registration handle (torch.library.Library and its define/impl carry no
# annotations: the ignores below are for that alone).
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class Operator:
    """A registered operator; call it through `torch.ops.kvferry.<name>`."""

    qualname: str

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """What the compiler traces instead of the kernel: outputs' shapes, no work."""
        torch.library.register_fake(self.qualname, fake, lib=_LIBRARY)
        return fake


def operator(
    name: str, *, mutates_args: Iterable[str], tags: tuple[torch.Tag, ...] = ()
) -> Callable[[Callable[..., Any]], Operator]:
    """Register the decorated function as the operator `kvferry::<name>`."""

    def register(kernel: Callable[..., Any]) -> Operator:
        schema = name + infer_schema(kernel, mutates_args=tuple(mutates_args))
        _LIBRARY.define(schema, tags=tags)  # type: ignore[no-untyped-call]
        _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
        return Operator(f"{NAMESPACE}::{name}")

    return register
