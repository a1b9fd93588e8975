"""Invariant 1 and the documented hook order, proven with the RecordingConnector."""

import json

import pytest

from kvferry.config import KVTransferConfig
from kvferry.connector.base import KVConnectorRole, MetadataNotBoundError
from kvferry.connector.recording import RecordingConnector
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm

WORKER_STEP_ORDER = [
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "clear_connector_metadata",
]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _steps(worker_records):
    """Split worker records into steps, each starting at bind_connector_metadata."""
    steps = []
    for rec in worker_records:
        if rec["hook"] == "bind_connector_metadata":
            steps.append([])
        assert steps, f"{rec['hook']} before any bind"
        steps[-1].append(rec)
    return steps


@pytest.fixture
def recorded_run(tiny_llama, tmp_path):
    path = tmp_path / "hooks.jsonl"
    transfer = KVTransferConfig("RecordingConnector", kv_connector_extra_config={"record_path": str(path)})
    llm = make_llm(tiny_llama, kv_transfer=transfer, budget=32)
    outputs = llm.generate(PROMPT_TEXTS[:4], SamplingParams(max_tokens=5, temperature=0))
    assert_pool_full(llm)
    return llm, _records(path), outputs


def test_every_forward_runs_with_scheduler_built_metadata(recorded_run):
    llm, records, _ = recorded_run
    built = [r["step"] for r in records if r["role"] == "scheduler" and r["hook"] == "build_connector_meta"]
    steps = _steps([r for r in records if r["role"] == "worker" and r["hook"] != "register_kv_caches"])
    # One worker step per metadata built, in the same order: warm-up steps included.
    assert [s[0]["step"] for s in steps] == built
    for step in steps:
        assert all(r["step"] == step[0]["step"] for r in step)  # read through self.metadata: bound
    num_layers = llm.config.model.num_layers
    forwards = [s for s in steps if any(r["hook"] == "save_kv_layer" for r in s)]
    assert len(forwards) >= 3 + 5  # 2 warm-up forwards + prefill chunks + decodes
    for step in forwards:
        saves = [r for r in step if r["hook"] == "save_kv_layer"]
        assert len(saves) == num_layers


def test_hook_order_matches_the_documented_contract(recorded_run):
    llm, records, _ = recorded_run
    worker = [r for r in records if r["role"] == "worker"]
    assert worker[0]["hook"] == "register_kv_caches"
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(llm.config.model.num_layers)]
    for step in _steps(worker[1:]):
        hooks = [r["hook"] for r in step]
        outer = [h for h in hooks if h not in ("wait_for_layer_load", "save_kv_layer")]
        assert outer == WORKER_STEP_ORDER
        inner = [
            (r["hook"], r["layer"]) for r in step if r["hook"] in ("wait_for_layer_load", "save_kv_layer")
        ]
        if inner:
            expected = [(h, layer) for layer in layers for h in ("wait_for_layer_load", "save_kv_layer")]
            assert inner == expected
            assert hooks.index("start_load_kv") < hooks.index("wait_for_layer_load")
    sched = [r["hook"] for r in records if r["role"] == "scheduler"]
    # Each request: matched-token query, then allocation; finished requests are reported.
    for req in ("0", "1", "2", "3"):
        mine = [r["hook"] for r in records if r.get("req") == req]
        assert mine.index("get_num_new_matched_tokens") < mine.index("update_state_after_alloc")
        assert mine[-1] == "request_finished"
    assert sched.count("update_connector_output") >= 1


def test_reading_metadata_outside_a_forward_raises(tiny_llama):
    import torch

    from kvferry.config import EngineConfig
    from kvferry.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, Layout
    from kvferry.model.resolve import resolve_model_config

    model = resolve_model_config(str(tiny_llama), dtype="float32")
    spec = FullAttentionSpec(16, 2, 16, torch.float32)
    kv = KVCacheConfig((KVCacheGroup(spec, ("a",)),), (), Layout.NHD, 4, 4)
    conn = RecordingConnector(EngineConfig(model=model), KVConnectorRole.WORKER, kv)
    with pytest.raises(MetadataNotBoundError, match="outside a forward"):
        conn.start_load_kv()
