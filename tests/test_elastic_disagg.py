"""P/D through a `kvferry proxy` with elastic KV memory on the decoder only (prefill TP=1,
decode TP=2), on the prefiller only (TP=2 -> TP=1) and on both (TP=2 -> TP=1): real
`kvferry serve` processes with NIXL agents, one proxy per pair. Greedy answers, streamed
or not, equal a colocated eager engine's byte for byte, text and token ids, with the
prompt's KV read over NIXL. At the end every block pool is all free and every elastic
side has returned every page it mapped (prefix caching is off, so nothing stays cached)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.pd_support import (
    Completion,
    Server,
    ServerSpec,
    colocated_greedy,
    complete,
    nixl,
    pages_all_returned,
    prompt_set,
    proxying,
    serving,
    wait_idle,
)

# slow: five `kvferry serve` processes (TP=2 among them) and three proxies (make test-all only)
pytestmark = pytest.mark.slow

MAX_TOKENS = 12
# fp32: TP sums agree; no prefix caching: an idle engine keeps no block, so every page goes back
COMMON = ("--max-num-batched-tokens", "64", "--dtype", "float32", "--enforce-eager", "--no-prefix-caching")
ELASTIC = (*COMMON, "--kv-allocator", "elastic")

# name: (role, TP size, elastic)
SERVERS = {
    "p_eager": ("producer", 1, False),
    "p_elastic": ("producer", 2, True),
    "d_elastic_tp2": ("consumer", 2, True),
    "d_eager": ("consumer", 1, False),
    "d_elastic": ("consumer", 1, True),
}
PAIRS = {  # elastic on: (prefiller, decoder)
    "decoder_only_tp1_2": ("p_eager", "d_elastic_tp2"),
    "prefiller_only_tp2_1": ("p_elastic", "d_eager"),
    "both_tp2_1": ("p_elastic", "d_elastic"),
}


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    specs = {
        name: ServerSpec(nixl(role), tp=tp, args=ELASTIC if elastic else COMMON)
        for name, (role, tp, elastic) in SERVERS.items()
    }
    with serving(tiny_llama, tmp_path_factory.mktemp("elastic_disagg"), specs) as started:
        yield started


@pytest.fixture(scope="module")
def proxies(servers: dict[str, Server], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One `kvferry proxy` per pair, by pair name: its URL."""
    pairs = {pair: (servers[p], servers[d]) for pair, (p, d) in PAIRS.items()}
    with proxying(pairs, tmp_path_factory.mktemp("elastic_disagg_proxy")) as urls:
        yield urls


@pytest.fixture(scope="module")
def prompts(tiny_llama: Path) -> list[str | list[int]]:
    return prompt_set(AutoTokenizer.from_pretrained(tiny_llama))


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, prompts: list, servers: dict) -> list[Completion]:
    """The colocated eager engine's greedy answers (computed while the servers start)."""
    return [
        Completion(o.text, list(o.token_ids), None) for o in colocated_greedy(tiny_llama, prompts, MAX_TOKENS)
    ]


def _num_tokens(tokenizer, prompt: str | list[int]) -> int:  # noqa: ANN001 - a HF tokenizer
    return len(prompt) if isinstance(prompt, list) else len(tokenizer.encode(prompt))


@pytest.mark.parametrize("pair", list(PAIRS))
def test_pd_through_the_proxy_with_elastic_memory_equals_colocated_eager(
    servers, proxies, prompts, reference, tiny_llama, pair
):
    prefiller, decoder = (servers[name] for name in PAIRS[pair])
    streams = [i % 2 == 1 for i in range(len(prompts))]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p, s: complete(proxies[pair], p, MAX_TOKENS, s), prompts, streams))
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    for prompt, answer, expected in zip(prompts, answers, reference, strict=True):
        assert (answer.text, answer.token_ids) == (expected.text, expected.token_ids), prompt
        if answer.cached is not None:  # every prompt token but the last came over NIXL
            assert answer.cached == _num_tokens(tok, prompt) - 1, prompt
    for server in (prefiller, decoder):
        wait_idle(server)
        if SERVERS[server.name][2]:
            m = pages_all_returned(server)
            assert m["kv_pages_mapped"] > 0  # elastic memory was used
        else:
            assert server.metrics()["kv_resident_bytes"] == server.metrics()["kv_reserved_bytes"] > 0
