"""P/D with 3 KV heads over TP=2 (ranks hold 2 + 1 heads), real NIXL agents, no HTTP.

A TP=2 engine (NHD) and a TP=1 engine (HND), both kv_role "both", prefill and decode for
each other: TP 2 -> 1 reads both prefill ranks' uneven head ranges into one rank, TP 1 -> 2
gives each decode rank its own range; outputs equal a colocated engine's; pools end free.
All three cores run eager (test_nixl_engine._config).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.config import KVTransferConfig
from kvferry.engine.core import EngineCore
from tests.engine_helpers import PROMPT_TEXTS, tokenize_all
from tests.test_nixl_engine import _config, _drain, _pd_round

# slow: TP=2 and TP=1 engine cores with NIXL agents, eager (make test-all only)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(tiny_llama_kv3: Path) -> Iterator[dict[str, EngineCore]]:
    both = KVTransferConfig("NixlConnector", kv_role="both", kv_connector_extra_config={"lease_s": 30})
    cores = {
        "tp2": EngineCore(_config(tiny_llama_kv3, both, "NHD", tp=2)),
        "tp1": EngineCore(_config(tiny_llama_kv3, both, "HND")),
        "colocated": EngineCore(_config(tiny_llama_kv3, None, "NHD")),
    }
    yield cores
    for core in cores.values():
        core.shutdown()


@pytest.mark.parametrize(("prefill", "decode"), [("tp2", "tp1"), ("tp1", "tp2")])
def test_uneven_heads_across_tp(engines, tiny_llama_kv3, prefill, decode):
    prompts = tokenize_all(tiny_llama_kv3, PROMPT_TEXTS)
    _pd_round(engines[prefill], engines[decode], engines["colocated"], prompts, tag=f"{prefill}-{decode}")
    _drain(engines[prefill], engines[decode])
