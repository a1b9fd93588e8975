"""Injected offload load failures: policy `fail` errors only the affected request, policy
`recompute` gives the right output; failed entries leave the index; pools end full.

The connectors below are loaded by module path (kv_connector_module_path), like any
out-of-tree connector.
"""

import pytest

from kvferry.connector.offload.connector import OffloadConnector
from kvferry.connector.offload.worker_side import OffloadWorker
from kvferry.messages.engine_core import FinishReason
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm
from tests.offload_support import (
    GREEDY,
    LONG,
    evict_device_cache,
    offload_config,
    sched_half,
    tokens,
)

MODULE = "tests.test_offload_failures"


class _UnreadableWorker(OffloadWorker):
    """Every tier read fails verification, so every load is reported as a load error."""

    def _read(self, load, out):
        return False


class UnreadableOffload(OffloadConnector):
    worker_class = _UnreadableWorker


class RaisingOffload(OffloadConnector):
    """start_load_kv raises whenever the step has loads (the ConnectorGuard path)."""

    def start_load_kv(self):
        if self._meta().loads:
            raise RuntimeError("injected load failure")
        super().start_load_kv()


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return tokens(make_llm(tiny_llama).generate([LONG, PROMPT_TEXTS[1]], GREEDY))


def _run_twice(tiny_llama, connector, policy):
    """Compute and offload LONG, drop it from the device, then run LONG beside another prompt."""
    llm = make_llm(tiny_llama, kv_transfer=offload_config(policy, connector, MODULE, dram_blocks=64))
    llm.generate(LONG, GREEDY)
    evict_device_cache(llm)
    return llm, llm.generate([LONG, PROMPT_TEXTS[1]], GREEDY)


@pytest.mark.slow  # several seconds (make test-all)
@pytest.mark.parametrize("connector", ["UnreadableOffload", "RaisingOffload"])
def test_recompute_policy_gives_the_correct_output(tiny_llama, expected, connector):
    llm, outs = _run_twice(tiny_llama, connector, "recompute")
    assert tokens(outs) == expected
    assert all(o.error is None for o in outs)
    assert outs[0].num_cached_tokens == 0  # the failed load does not count as cached
    assert len(sched_half(llm).index) == 7  # the unreadable entries left; the recompute saved anew
    assert_pool_full(llm)


def test_fail_policy_errors_only_the_request_whose_load_failed(tiny_llama, expected):
    llm, outs = _run_twice(tiny_llama, "UnreadableOffload", "fail")
    assert outs[0].error and outs[0].outputs[0].finish_reason == FinishReason.ERROR
    assert outs[1].error is None and tokens(outs[1:]) == expected[1:]
    assert sched_half(llm).totals["offload_load_errors"] == 7
    assert len(sched_half(llm).index) == 0  # nothing unreadable is offered again
    assert_pool_full(llm)
    # The next time the prompt is computed (and saved) from scratch.
    assert tokens(llm.generate(LONG, GREEDY)) == expected[:1]
    assert_pool_full(llm)


@pytest.mark.slow  # several seconds (make test-all)
def test_fail_policy_with_a_raising_load_hook_fails_the_steps_requests(tiny_llama, expected):
    llm, outs = _run_twice(tiny_llama, "RaisingOffload", "fail")
    # A hook that raises taints every block of its step: both requests fail, nothing leaks.
    assert all(o.outputs[0].finish_reason == FinishReason.ERROR for o in outs)
    assert_pool_full(llm)
    assert tokens(llm.generate([LONG, PROMPT_TEXTS[1]], GREEDY)) == expected
    assert_pool_full(llm)
