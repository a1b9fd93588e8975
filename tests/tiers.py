"""The fast tier (`make test`: `pytest -m "not slow"`) and `make test-all` (CI: every test).

A test is marked slow when it takes more than a few seconds (servers, compiling, TP ranks,
soaks); each capability keeps at least one end-to-end test unmarked (tests/test_tiers.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from tests.fixtures.tiny_models import ARCHS

SLOW = pytest.mark.slow


def first_fast(values: Iterable[object]) -> list[object]:
    """Parameters with the first in the fast tier and the others marked slow."""
    first, *rest = values
    return [first, *(pytest.param(value, marks=SLOW) for value in rest)]


# For `@pytest.mark.parametrize("tiny_model", LLAMA_FAST, indirect=True)`: the tiny llama in
# the fast tier, qwen2 and qwen3 in make test-all (the test ids stay [llama], [qwen2], [qwen3]).
LLAMA_FAST = first_fast(ARCHS)
