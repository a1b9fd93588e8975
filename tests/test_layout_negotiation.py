"""Invariant 5: the engine's KV layout is one the allocator and every connector accept.
--kv-layout is a preference; a connector that accepts only HND gets HND tensors (and the
same greedy answers), and connectors that share no layout stop the start-up with an error
naming who accepts what."""

from __future__ import annotations

import json
import logging

import pytest

from kvferry.config import KVTransferConfig
from kvferry.connector.base import KVConnectorBase
from kvferry.errors import ConfigError
from kvferry.kv.layout_choice import LayoutParty, choose_layout
from kvferry.kv.spec import Layout
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import assert_pool_full, make_llm

PROMPTS = ["the quick brown fox jumps over", "a b c d e f g h i j k l m n o p q r s t u v w"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
MODULE = __name__


class HndOnlyConnector(KVConnectorBase):
    """Moves nothing; accepts HND only and records the tensors it is handed."""

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


def test_the_preference_is_kept_when_everyone_accepts_it():
    both = LayoutParty("a", (Layout.NHD, Layout.HND))
    assert choose_layout(Layout.HND, [both, LayoutParty("b", (Layout.HND, Layout.NHD))]) is Layout.HND
    assert choose_layout(Layout.NHD, [both, both]) is Layout.NHD


def test_a_refused_preference_gives_way_with_a_warning(caplog):
    parties = [LayoutParty("the allocator", (Layout.NHD, Layout.HND)), LayoutParty("X", (Layout.HND,))]
    with caplog.at_level(logging.WARNING, logger="kvferry.kv.layout_choice"):
        assert choose_layout(Layout.NHD, parties) is Layout.HND
    assert "not accepted by X" in caplog.text


def test_no_common_layout_names_who_accepts_what():
    parties = [LayoutParty("A", (Layout.NHD,)), LayoutParty("B", (Layout.HND,)), LayoutParty("C", ())]
    with pytest.raises(ConfigError, match="A accepts NHD; B accepts HND; C accepts no layout"):
        choose_layout(Layout.NHD, parties)


def test_an_hnd_only_connector_gets_hnd_tensors_and_the_same_answers(tiny_llama, tmp_path):
    record = tmp_path / "record.json"
    expected = tokens(make_llm(tiny_llama, enforce_eager=True).generate(PROMPTS, GREEDY))
    transfer = KVTransferConfig.from_dict(_connector("HndOnlyConnector", record_path=str(record)))
    llm = make_llm(tiny_llama, kv_transfer=transfer, enforce_eager=True)  # preference: NHD (default)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    assert_pool_full(llm)
    seen = json.loads(record.read_text())
    assert seen["layout"] == "HND"
    for shape in seen["shapes"].values():  # [2, blocks, kv_heads, block_size, head_dim]
        assert shape[3] == 16 and shape[2] != 16


def test_connectors_that_share_no_layout_stop_the_start_up(tiny_llama):
    extra = {"connectors": [_connector("HndOnlyConnector"), _connector("NhdOnlyConnector")]}
    transfer = KVTransferConfig("MultiConnector", kv_connector_extra_config=extra)
    with pytest.raises(ConfigError, match="HndOnlyConnector accepts HND; NhdOnlyConnector accepts NHD"):
        make_llm(tiny_llama, kv_transfer=transfer)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]
