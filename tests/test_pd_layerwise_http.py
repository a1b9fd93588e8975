"""Layer-wise P/D through `kvferry proxy`: real `kvferry serve` processes, real NIXL agents.

The prefill instances run the NixlConnector with ``"layerwise": true``; the proxy finds
that at ``GET /v1/kv_transfer/source`` and sends each leg's prefill and decode requests
together: the decoder reads each layer's KV as the prefiller's forward saves it, and
outputs the prefiller's first token from the acknowledgement. Across TP sizes (1 -> 2
with a layout change, 2 -> 1), for a plain model, a sliding-window model (Gemma 3) and
elastic KV memory on both sides, greedy answers, streamed or not, equal a colocated
engine's byte for byte; the proxy counts every leg as streamed, the decoders count layers
read before their prefill finished, and every pool ends all free.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests import plain_http
from tests.pd_support import (
    ServerSpec,
    colocated_greedy,
    complete,
    nixl,
    prompt_set,
    proxying,
    serving,
    wait_idle,
)

# slow: per deployment, four `kvferry serve` processes (two with two TP ranks) and three
# proxies (make test-all only)
pytestmark = pytest.mark.slow

MAX_TOKENS = 10
CHUNK = ("--max-num-batched-tokens", "64", "--dtype", "float32")
LAYERWISE = {"layerwise": True, "fault_layer_delay_s": 0.01}  # a slower forward: reads overlap it
PAIRS = {"1to2": ("p1", "d2"), "2to1": ("p2", "d1"), "1to1": ("p1", "d1")}


# (model fixture, extra serve args): a plain model with the eager allocator, a sliding-window
# model with KV tensors shared by layers, the plain model with elastic KV memory on both sides
DEPLOYMENTS = {
    "llama": ("tiny_llama", ()),
    "gemma3": ("tiny_gemma3", ()),
    "llama-elastic": ("tiny_llama", ("--kv-allocator", "elastic")),
}


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def deployment(request: pytest.FixtureRequest) -> tuple[Path, tuple[str, ...]]:
    model_fixture, args = DEPLOYMENTS[request.param]
    return request.getfixturevalue(model_fixture), args


@pytest.fixture(scope="module")
def servers(
    deployment: tuple[Path, tuple[str, ...]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict]:
    model, extra_args = deployment
    args = (*CHUNK, *extra_args)
    specs = {
        "p1": ServerSpec(nixl("producer", **LAYERWISE), args=args),
        "p2": ServerSpec(nixl("producer", **LAYERWISE), tp=2, args=args),
        "d1": ServerSpec(nixl("consumer"), args=args),
        "d2": ServerSpec(nixl("consumer"), tp=2, layout="HND", args=args),
    }
    with serving(model, tmp_path_factory.mktemp("pd_layerwise"), specs) as started:
        yield started


@pytest.fixture(scope="module")
def proxies(servers: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    pairs = {name: (servers[p], servers[d]) for name, (p, d) in PAIRS.items()}
    with proxying(pairs, tmp_path_factory.mktemp("pd_layerwise_proxy")) as urls:
        yield urls


@pytest.fixture(scope="module")
def prompts(deployment: tuple[Path, tuple[str, ...]]) -> list[str | list[int]]:
    return prompt_set(AutoTokenizer.from_pretrained(deployment[0]))


@pytest.fixture(scope="module")
def reference(deployment: tuple[Path, tuple[str, ...]], prompts: list) -> list[str]:
    return [o.text for o in colocated_greedy(deployment[0], prompts, MAX_TOKENS)]


def _proxy_count(url: str, sample: str) -> float:
    text = plain_http.get(url + "/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith(sample + " ")]
    return float(lines[0].rpartition(" ")[2]) if lines else 0.0


STREAMED = 'kvferry_proxy:prefill_path_total{path="streamed"}'
EARLY = "kvferry_proxy:early_first_tokens_total"


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "sse"])
def test_layerwise_answers_equal_colocated(servers, proxies, prompts, reference, deployment, pair, stream):
    tokenizer = AutoTokenizer.from_pretrained(deployment[0])
    url = proxies[pair]
    decoder = servers[PAIRS[pair][1]]
    before = decoder.metrics()
    early_before = _proxy_count(url, EARLY)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: complete(url, p, MAX_TOKENS, stream), prompts))
    for prompt, result, expected in zip(prompts, results, reference, strict=True):
        assert result.text == expected, prompt
        if result.cached is not None:  # every prompt token but the last came over NIXL
            assert result.cached == len(prompt if isinstance(prompt, list) else tokenizer.encode(prompt)) - 1
    assert _proxy_count(url, STREAMED) >= len(prompts)
    # Streamed answers: the prefill's token went to the client before the decoder's stream
    # (the decoder's first chunk waits for the prefill's end, then a read and a step).
    assert (_proxy_count(url, EARLY) > early_before) is stream
    after = wait_idle(decoder)
    wait_idle(servers[PAIRS[pair][0]])
    early = after.get("kv_connector_nixl_layers_read_early", 0) - before.get(
        "kv_connector_nixl_layers_read_early", 0
    )
    assert early > 0, after  # layers were read while their prefill still computed


def test_the_source_is_the_proxys_and_only_a_streaming_prefiller_has_one(servers):
    source = plain_http.get(servers["p2"].url + "/v1/kv_transfer/source", timeout=10)
    assert source.status_code == 200, source.text
    params = source.json()["kv_transfer_params"]
    assert params["remote_tp_size"] == 2 and params["do_remote_prefill"] is True
    missing = plain_http.get(servers["d1"].url + "/v1/kv_transfer/source", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
