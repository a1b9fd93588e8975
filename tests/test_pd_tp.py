"""P/D across tensor-parallel sizes: prefill TP=1 -> decode TP=2 (each decode rank reads
its KV-head slice), prefill TP=2 -> decode TP=1 (one decode rank reads from both prefill
ranks), and TP=2 -> TP=2; the TP=2 decoder also converts NHD to HND on receive.
Outputs equal a colocated engine's; the prefiller frees blocks once every consuming rank
is done, and every pool ends all free.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams
from tests.pd_support import (
    Server,
    decode,
    prefill,
    prompt_set,
    serving,
    tp_matrix,
    wait_idle,
)

# slow: four `kvferry serve` processes, two of them TP=2 (make test-all only)
pytestmark = pytest.mark.slow

MAX_TOKENS = 12
CHUNK = ("--max-num-batched-tokens", "64")


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    with serving(tiny_llama, tmp_path_factory.mktemp("pd_tp"), tp_matrix(CHUNK)) as started:
        yield started


@pytest.fixture(scope="module")
def prompts(tiny_llama: Path) -> list[str | list[int]]:
    return prompt_set(AutoTokenizer.from_pretrained(tiny_llama))


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, prompts: list, servers: dict) -> list[str]:
    llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20, max_num_batched_tokens=64, enforce_eager=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [o.outputs[0].text for o in outs]


def _pd(prefiller: Server, decoder: Server, prompt) -> tuple[str, int, dict]:
    params = prefill(prefiller, prompt)
    resp = decode(decoder, prompt, params, MAX_TOKENS)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"], params


@pytest.mark.parametrize(("prefill_name", "decode_name"), [("p1", "d2"), ("p2", "d1"), ("p2", "d2")])
def test_heterogeneous_tp(servers, prompts, reference, prefill_name, decode_name):
    prefiller, decoder = servers[prefill_name], servers[decode_name]
    before = decoder.metrics().get("kv_connector_nixl_bytes_read", 0.0)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: _pd(prefiller, decoder, p), prompts))
    for prompt, (text, cached, params), expected in zip(prompts, results, reference, strict=True):
        assert text == expected, prompt
        assert cached == params["remote_num_tokens"] - 1
        assert params["remote_tp_size"] == (2 if prefill_name == "p2" else 1)
    assert decoder.metrics()["kv_connector_nixl_bytes_read"] > before
    wait_idle(decoder)
    wait_idle(prefiller)  # every consuming rank reported: all blocks back
