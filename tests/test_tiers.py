"""The test tiers: `make test` runs the fast tier (`pytest -m "not slow"`), `make test-all`
every test, and CI (.ci/run) runs `make test-all`. The fast tier keeps at least one
end-to-end test of each capability: the representatives below must be selected by
`-m "not slow"`; marking one slow (or renaming it) fails here."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.test_type_check import recipe

ROOT = Path(__file__).resolve().parent.parent
SLOW_MARKER = "slow: runs only in make test-all (CI), not in the fast tier"

# capability -> the fast-tier test that runs it end to end
REPRESENTATIVES = {
    "P/D: prefill + decode over NIXL through the proxy (kvferry disagg)": (
        "tests/test_disagg.py::test_pd_over_nixl_is_byte_identical_to_a_colocated_engine"
    ),
    "tensor parallelism: a TP=2 answer": "tests/test_tp.py::test_tp2_greedy_outputs_identical_to_tp1[llama]",
    "the captured forward: compiled decode steps": (
        "tests/test_capture.py::test_captured_greedy_equals_eager[llama-3]"
    ),
    "elastic KV memory: pages committed and returned": (
        "tests/test_elastic_engine.py::test_resident_memory_follows_the_blocks_in_use"
    ),
    "offload: a prompt served from the DRAM tier": (
        "tests/test_offload.py::test_dram_tier_serves_a_repeated_prompt_and_its_bytes_are_used"
    ),
    "hybrid (sliding-window) models: Gemma 3 against HF": (
        "tests/test_model_hybrid.py::test_batched_greedy_matches_hf[gemma3]"
    ),
    "latent attention and mixture-of-experts models: DeepSeek-V3 against HF": (
        "tests/test_model_moe.py::test_chunked_prefill_with_prefix_cache_matches_hf"
        "[deepseek_v3-prefill_decompressed-decode_absorbed]"
    ),
    "latent attention with each phase in its other form (prefill absorbed, decode decompressed)": (
        "tests/test_model_moe.py::test_chunked_prefill_with_prefix_cache_matches_hf"
        "[deepseek_v3-prefill_absorbed-decode_decompressed]"
    ),
    "the embedded SmolLM2 GGUF against HF": "tests/test_model_gguf.py::test_greedy_continuation_matches_hf",
    "speculative decoding: drafting servers, colocated and a P/D decoder, over HTTP": (
        "tests/test_spec_decode_http.py::test_drafting_servers_answer_as_a_plain_one"
    ),
    "the OpenAI server: `kvferry serve` over HTTP": (
        "tests/test_server_e2e.py::test_completions_match_offline_engine"
    ),
    "P/D between two engine cores over NIXL, converting the layout": (
        "tests/test_nixl_engine.py::test_both_roles_prefill_and_decode_for_each_other[nhd_to_hnd]"
    ),
    "offload, layer-wise: a prompt loaded and saved through the per-layer hooks": (
        "tests/test_offload_layerwise.py::test_layerwise_offload_serves_a_repeated_prompt"
    ),
    "MultiConnector: two offload tiers": (
        "tests/test_multi_connector.py::test_two_offload_tiers_load_from_the_first_with_a_hit"
    ),
    "KV load failures, layer-wise offload: a read failing at the second layer": (
        "tests/test_offload_layerwise_failures.py::"
        "test_a_read_that_fails_for_the_second_layer_fails_only_its_loads[later-loads-fail]"
    ),
    "KV load failures: policy fail": (
        "tests/test_offload_failures.py::test_fail_policy_errors_only_the_request_whose_load_failed"
    ),
    "one KV memory pool shared by two engines": (
        "tests/test_elastic_pool_engines.py::test_bursts_take_turns_on_one_pool_where_eager_halves_preempt"
    ),
    "the CPU prefill kernel in an engine": "tests/test_prefill_kernel.py::test_an_engine_prefills_through_the_kernel[8]",
    "the CPU decode kernel in an engine": "tests/test_decode_kernel.py::test_an_engine_decodes_through_the_kernel",
    "the fused GGUF decode layer in an engine": (
        "tests/test_fused_decode.py::test_an_engine_decodes_through_it_as_the_gguf_reference_does"
    ),
    "structured outputs: JSON-schema answers validate": (
        "tests/test_structured.py::test_json_schema_answers_validate[0.0]"
    ),
    "the authenticated side channel": (
        "tests/test_side_channel_units.py::test_an_authenticated_client_is_served_and_knows_who_answered"
    ),
    "vLLM's request extras over HTTP: n, min_tokens, logit_bias, prompt_logprobs": (
        "tests/test_server_e2e.py::test_n_min_tokens_and_prompt_logprobs"
    ),
    "prompt_logprobs streamed and in chat": "tests/test_server_e2e.py::test_prompt_logprobs_streamed_and_in_chat",
    "KV layout negotiation with a connector": (
        "tests/test_layout_negotiation.py::test_an_hnd_only_connector_gets_hnd_tensors_and_the_same_answers"
    ),
    "KV events from a real engine to a subscriber": (
        "tests/test_kv_events.py::test_engine_events_reach_a_subscriber_and_replay_fills_gaps"
    ),
    "prefix routing's event feed, replay and restart": (
        "tests/test_prefix_routing.py::test_feed_replays_gaps_and_relearns_after_a_restart"
    ),
}


# A test marked slow by tests/tiers.LLAMA_FAST (its [llama] sibling is fast): never in the fast tier.
SLOW_EXAMPLE = "tests/test_engine_equivalence.py::test_batched_greedy_matches_hf[qwen2]"


@pytest.fixture(scope="module")
def fast_tier() -> set[str]:
    """The node ids among the representatives and SLOW_EXAMPLE that `pytest -m "not slow"`
    selects (one collection in a subprocess, as `make test` runs it)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow", "-p", "no:cacheprovider"]
    nodes = [*REPRESENTATIVES.values(), SLOW_EXAMPLE]
    done = subprocess.run([*cmd, *nodes], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {line.strip() for line in done.stdout.splitlines() if "::" in line}


def test_each_capability_keeps_an_end_to_end_test_in_the_fast_tier(fast_tier: set[str]) -> None:
    missing = {name: node for name, node in REPRESENTATIVES.items() if node not in fast_tier}
    assert not missing, f"marked slow or gone: {missing}"


def test_a_test_marked_slow_is_left_out_of_the_fast_tier(fast_tier: set[str]) -> None:
    """The check above can fail: a slow test, named the same way, is not selected."""
    assert SLOW_EXAMPLE not in fast_tier


def test_make_test_is_the_fast_tier_and_ci_runs_every_test() -> None:
    fast = [c for c in recipe("test") if "pytest" in c]
    every = [c for c in recipe("test-all") if "pytest" in c]
    assert len(fast) == len(every) == 1
    assert fast[0].endswith('pytest -q -m "not slow" tests') and every[0].endswith("pytest -q tests")
    assert any(c.split()[0].endswith("/mypy") for c in recipe("test-all"))
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if not line.startswith("#")]
    assert "make test-all" in ci and "make test" not in ci
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert SLOW_MARKER in markers
