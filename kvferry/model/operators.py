"""kvferry's operators: registered with torch's dispatcher directly.

`torch.library.custom_op` wraps a Python function in two Python layers per call (an
autograd kernel, then the implementation), several times the cost of a function
registered as the operator's only kernel (docs/benchmarks.md, "bf16 decode"). A decode
step calls one operator per linear and per attention layer (~150 for SmolLM2), eagerly and
from a compiled graph alike, so kvferry registers its operators this way: the schema
inferred from the function's annotations (as `custom_op` does), the function as the CompositeExplicitAutograd
kernel (kvferry's forwards never need gradients), a fake kernel for the compiler.

Callers call the `Operator` itself. While the compiler traces, that is the registered
operator, so a captured graph holds one opaque call (the fake kernel gives its shapes);
eagerly, it is the kernel function called directly: the dispatcher's round trip into
Python costs each call a few microseconds more and decides nothing an eager call needs
(one kernel, no autograd). Measured on a 64x576 GGUF linear: 14.5 us through
`torch.ops.kvferry.gguf_linear`, 11.0 us for its kernel called directly (AVX-512 EPYC,
2026-11-28).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch._library.infer_schema import infer_schema
from torch._library.utils import lookup_op

NAMESPACE = "kvferry"
# The namespace's registration handle (torch.library.Library and its define/impl carry no
# annotations: the ignores below are for that alone).
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")  # type: ignore[no-untyped-call]


@dataclass(frozen=True)
class Operator:
    """A registered operator: call it (see the module docstring); `torch.ops.kvferry.<name>`
    is the same operator through the dispatcher."""

    qualname: str
    kernel: Callable[..., Any]  # the Python function registered as its one kernel
    registered: torch._ops.OpOverload  # the operator, as a captured graph calls it

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.registered(*args)
        return self.kernel(*args)

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
        qualname = f"{NAMESPACE}::{name}"
        return Operator(qualname, kernel, lookup_op(f"{qualname}.default"))

    return register
