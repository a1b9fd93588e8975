"""The KV connector is resolved once per process (kvferry.connector.factory.resolve_connector):
its class, its settled settings and its children ride in EngineConfig.connector, and the
engine, the executor, the workers and the front end read that spec instead of resolving
the connector again."""

from __future__ import annotations

import dataclasses

import pytest

from kvferry.config import EngineConfig, KVTransferConfig
from kvferry.connector import factory
from kvferry.connector.factory import connector_spec, kv_params_validator, resolve_connector
from kvferry.connector.multi import MultiConnector
from kvferry.connector.offload.connector import OffloadConnector
from kvferry.connector.recording import RecordingConnector
from kvferry.model.resolve import resolve_model_config
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import assert_pool_full, make_llm

RECORDING = {"kv_connector": "RecordingConnector"}
OFFLOAD = {"kv_connector": "OffloadConnector", "kv_connector_extra_config": {"dram_blocks": 64}}


def _multi() -> KVTransferConfig:
    return KVTransferConfig("MultiConnector", kv_connector_extra_config={"connectors": [RECORDING, OFFLOAD]})


def test_an_engine_resolves_each_connector_of_its_tree_once(tiny_llama, monkeypatch):
    looked_up: list[str | None] = []
    find = factory._connector_class

    def counting(config: KVTransferConfig):
        looked_up.append(config.kv_connector)
        return find(config)

    monkeypatch.setattr(factory, "_connector_class", counting)
    llm = make_llm(tiny_llama, kv_transfer=_multi())
    out = llm.generate(["the quick brown fox"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    assert looked_up == ["MultiConnector", "RecordingConnector", "OffloadConnector"]
    spec = llm.engine.config.connector
    assert spec is not None and spec.connector_class is MultiConnector
    assert [c.connector_class for c in spec.children] == [RecordingConnector, OffloadConnector]
    assert [type(c) for c in llm.engine.connector.children] == [RecordingConnector, OffloadConnector]
    assert_pool_full(llm)


def test_a_resolved_config_is_resolved_once_and_read_as_it_is(tiny_llama):
    config = EngineConfig(model=resolve_model_config(str(tiny_llama)), kv_transfer=_multi())
    with pytest.raises(RuntimeError, match="not resolved"):
        connector_spec(config)
    resolved = resolve_connector(config)
    assert resolve_connector(resolved) is resolved
    assert (
        connector_spec(resolved) is resolved.connector and resolved.kv_transfer is resolved.connector.transfer
    )
    assert (
        kv_params_validator(resolved) is not None
        and kv_params_validator(EngineConfig(model=config.model)) is None
    )
    changed = dataclasses.replace(resolved, kv_transfer=KVTransferConfig("RecordingConnector"))
    with pytest.raises(RuntimeError, match="not resolved"):  # a stale spec is never read
        connector_spec(changed)
    assert resolve_connector(changed).connector.connector_class is RecordingConnector


def test_nixl_settles_its_engine_id_and_port_once_for_every_half(tiny_llama):
    transfer = KVTransferConfig("NixlConnector", kv_role="producer")
    resolved = resolve_connector(
        EngineConfig(model=resolve_model_config(str(tiny_llama)), kv_transfer=transfer)
    )
    extra = resolved.kv_transfer.kv_connector_extra_config
    assert extra["engine_id"].startswith("kvf-") and extra["side_channel_port"] > 0
    assert resolve_connector(resolved).kv_transfer.kv_connector_extra_config == extra
    assert transfer.kv_connector_extra_config == {}  # the user's config is left as it was
