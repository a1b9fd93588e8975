"""P/D between real `kvferry serve` instances across TP sizes, with elastic KV memory:
prefill TP=1 (eager allocator) -> decode TP=2 (elastic, HND: converts on receive; each
decode rank reads its KV-head slice), prefill TP=2 (elastic) -> decode TP=1 (elastic; one
decode rank reads from both prefill ranks), and TP=2 -> TP=2 (both elastic). Outputs equal
a colocated eager engine's, the prefill's `remote_tp_size` names the prefiller's TP, the
decoder's NIXL byte counter grows, the prefiller frees its blocks once every consuming rank
reported, and every pool ends all free. (P/D across TP with the eager allocator on both
sides: tests/test_pd_hybrid.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.pd_support import (
    Server,
    colocated_greedy,
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
CHUNK = ("--max-num-batched-tokens", "64", "--dtype", "float32")  # fp32: TP sums agree
ELASTIC = (*CHUNK, "--kv-allocator", "elastic")


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    with serving(tiny_llama, tmp_path_factory.mktemp("elastic_pd_tp"), tp_matrix(CHUNK, ELASTIC)) as started:
        yield started


@pytest.fixture(scope="module")
def prompts(tiny_llama: Path) -> list[str | list[int]]:
    return prompt_set(AutoTokenizer.from_pretrained(tiny_llama))


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, prompts: list, servers: dict) -> list[str]:
    return [o.text for o in colocated_greedy(tiny_llama, prompts, MAX_TOKENS)]


def _pd(prefiller: Server, decoder: Server, prompt) -> tuple[str, int, dict]:  # noqa: ANN001 - str or ids
    params = prefill(prefiller, prompt)
    resp = decode(decoder, prompt, params, MAX_TOKENS)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"], params


@pytest.mark.parametrize(("prefill_name", "decode_name"), [("p1", "d2"), ("p2", "d1"), ("p2", "d2")])
def test_pd_across_tp_sizes_with_elastic_memory(servers, prompts, reference, prefill_name, decode_name):
    prefiller, decoder = servers[prefill_name], servers[decode_name]
    before = decoder.metrics().get("kv_connector_nixl_bytes_read", 0.0)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: _pd(prefiller, decoder, p), prompts))
    for prompt, (text, cached, params), expected in zip(prompts, results, reference, strict=True):
        assert text == expected, prompt
        assert cached == params["remote_num_tokens"] - 1  # the prompt's KV came over NIXL
        assert params["remote_tp_size"] == (2 if prefill_name == "p2" else 1)
    assert decoder.metrics()["kv_connector_nixl_bytes_read"] > before
    wait_idle(decoder)
    wait_idle(prefiller)  # every consuming rank reported: all blocks back
