"""Invariant 5: the engine's KV layout is --kv-layout, as given. Both allocators and every
built-in connector work with either layout (NIXL converts between a prefiller's and a
decoder's: tests/test_pd_e2e.py, tests/test_nixl_engine.py); a connector that works with
one only gets its tensors in that layout, or the start-up stops with an error naming it."""

from __future__ import annotations

import importlib
import json

import pytest

from kvferry.config import KVTransferConfig
from kvferry.connector.base import KVConnectorBase
from kvferry.connector.factory import BUILTIN_CONNECTORS
from kvferry.errors import ConfigError
from kvferry.kv.spec import Layout
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import assert_pool_full, make_llm

PROMPTS = ["the quick brown fox jumps over", "a b c d e f g h i j k l m n o p q r s t u v w"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
MODULE = __name__


class HndOnlyConnector(KVConnectorBase):
    """Moves nothing; works with HND only and records the tensors it is handed."""

    supported_layouts = (Layout.HND,)

    def register_kv_caches(self, kv_caches, kv_cache_config) -> None:
        shapes = {name: list(t.shape) for name, t in kv_caches.items()}
        record = {"layout": kv_cache_config.layout.value, "shapes": shapes}
        with open(self.extra_config["record_path"], "w") as f:
            json.dump(record, f)


class NhdOnlyConnector(KVConnectorBase):
    supported_layouts = (Layout.NHD,)


def _connector(name: str, **extra) -> dict:
    return {"kv_connector": name, "kv_connector_module_path": MODULE, "kv_connector_extra_config": extra}


@pytest.mark.parametrize("name", sorted(BUILTIN_CONNECTORS))
def test_every_built_in_connector_works_with_both_layouts(name):
    module, class_name = BUILTIN_CONNECTORS[name].split(":")
    cls = getattr(importlib.import_module(module), class_name)
    assert set(cls.supported_layouts) == {Layout.NHD, Layout.HND}


def test_an_hnd_only_connector_gets_hnd_tensors_and_the_same_answers(tiny_llama, tmp_path):
    record = tmp_path / "record.json"
    expected = tokens(make_llm(tiny_llama, enforce_eager=True).generate(PROMPTS, GREEDY))
    transfer = KVTransferConfig.from_dict(_connector("HndOnlyConnector", record_path=str(record)))
    llm = make_llm(tiny_llama, kv_transfer=transfer, enforce_eager=True, kv_layout="HND")
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    assert_pool_full(llm)
    seen = json.loads(record.read_text())
    assert seen["layout"] == "HND"
    for shape in seen["shapes"].values():  # [2, blocks, kv_heads, block_size, head_dim]
        assert shape[3] == 16 and shape[2] != 16


def test_a_layout_the_connector_does_not_work_with_stops_the_start_up(tiny_llama):
    transfer = KVTransferConfig.from_dict(_connector("HndOnlyConnector"))
    with pytest.raises(ConfigError, match="HndOnlyConnector works with KV layout HND, not --kv-layout NHD"):
        make_llm(tiny_llama, kv_transfer=transfer)  # --kv-layout NHD, the default


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_connectors_that_share_no_layout_stop_the_start_up(tiny_llama, layout):
    extra = {"connectors": [_connector("HndOnlyConnector"), _connector("NhdOnlyConnector")]}
    transfer = KVTransferConfig("MultiConnector", kv_connector_extra_config=extra)
    refusing = {"NHD": "HndOnlyConnector", "HND": "NhdOnlyConnector"}[layout]
    with pytest.raises(ConfigError, match=f"{refusing} works with KV layout"):
        make_llm(tiny_llama, kv_transfer=transfer, kv_layout=layout)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]
