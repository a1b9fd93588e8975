"""P/D over NIXL with the tiny Gemma 3 (sliding and full layers in shared tensors): outputs
equal a colocated engine's for prefill/decode TP (1,1), (1,2), (2,1), (2,2), the TP=2
decoder converting NHD to HND on receive; the bytes read are exactly the blocks each
group's window sees; every pool ends all free. The tiny Gemma 4 likewise for TP (1,1) and
(1,2) (HND), its KV-shared layers transferred once (they own no KV), its sliding groups'
padded pages read as stored; a decoder whose KV cache groups differ from the prefiller's
answers 400 naming the difference."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kvferry.config import KVTransferConfig
from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import make_llm
from tests.pd_support import (
    Server,
    decode,
    prefill,
    prompt_set,
    serving,
    tp_matrix,
    wait_idle,
)

# slow: seven `kvferry serve` processes (four TP=2) (make test-all only)
pytestmark = pytest.mark.slow

MAX_TOKENS = 12
# Chunked prefill; eager servers like the colocated reference (compiling seven servers'
# decode steps took ~5 of this file's 6 minutes; test_capture proves compiled = eager).
CHUNK = ("--max-num-batched-tokens", "64", "--enforce-eager")


@pytest.fixture(scope="module")
def servers(tiny_gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    with serving(tiny_gemma3, tmp_path_factory.mktemp("pd_hybrid"), tp_matrix(CHUNK)) as started:
        yield started


@pytest.fixture(scope="module")
def prompts(tiny_gemma3: Path) -> list[str | list[int]]:
    return prompt_set(AutoTokenizer.from_pretrained(tiny_gemma3))


@pytest.fixture(scope="module")
def reference(tiny_gemma3: Path, prompts: list) -> list[str]:
    llm = LLM(str(tiny_gemma3), kv_cache_bytes=5 << 20, max_num_batched_tokens=64, enforce_eager=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [o.outputs[0].text for o in outs]


BLOCK = 16  # kvferry serve's default block size
PAGE = BLOCK * 2 * 16 * 4 * 2  # one layer's block: 2 KV heads of 16 floats, K and V
WINDOW = 10


def _visible_bytes(num_loaded: int) -> int:
    """What a decoder reads for `num_loaded` prompt tokens: every block of the full group,
    and of each sliding group only the blocks the next token's window sees (2 layers each)."""
    full = -(-num_loaded // BLOCK)
    first_seen = max(0, num_loaded - WINDOW + 1) // BLOCK
    sliding = full - first_seen
    return (full + 2 * sliding) * 2 * PAGE


def _pd(prefiller: Server, decoder: Server, prompt) -> tuple[str, int, dict]:  # noqa: ANN001
    params = prefill(prefiller, prompt)
    resp = decode(decoder, prompt, params, MAX_TOKENS)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"], params


@pytest.mark.parametrize(
    ("prefill_name", "decode_name"), [("p1", "d1"), ("p1", "d2"), ("p2", "d1"), ("p2", "d2")]
)
def test_gemma3_pd_equals_colocated(servers, prompts, reference, prefill_name, decode_name) -> None:
    prefiller, decoder = servers[prefill_name], servers[decode_name]
    before = decoder.metrics().get("kv_connector_nixl_bytes_read", 0.0)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: _pd(prefiller, decoder, p), prompts))
    for prompt, (text, cached, params), expected in zip(prompts, results, reference, strict=True):
        assert text == expected, prompt
        assert cached == params["remote_num_tokens"] - 1
    assert decoder.metrics()["kv_connector_nixl_bytes_read"] > before
    wait_idle(decoder)
    wait_idle(prefiller)


def test_a_decoder_reads_only_the_blocks_each_window_sees(servers) -> None:
    """Prompts sharing no block with any other (no local prefix hit), one at a time."""
    prefiller, decoder = servers["p1"], servers["d1"]
    gen = torch.Generator().manual_seed(11)
    for length in (40, 73, 200, 161, 170):  # 170: the next token's window starts on a block
        prompt = torch.randint(10, 800, (length,), generator=gen).tolist()
        before = decoder.metrics().get("kv_connector_nixl_bytes_read", 0.0)
        text, cached, params = _pd(prefiller, decoder, prompt)
        read = decoder.metrics()["kv_connector_nixl_bytes_read"] - before
        assert cached == length - 1 and read == _visible_bytes(length - 1), (length, read)
    wait_idle(decoder)
    wait_idle(prefiller)


def test_a_decoder_never_offers_a_prefix_hit_on_blocks_it_did_not_receive(servers, tiny_gemma3: Path) -> None:
    """A 161-token prompt through P/D: the decoder loads 160 tokens and holds sliding blocks
    8 and 9 (block 8 for a prefix hit at token 144), but the window of token 160 sees only
    block 9, the only one read. A later prompt sharing the first 144 tokens, sent to the
    decoder alone, computes tokens 144-152 whose windows reach into block 8: its output
    equals a colocated engine's only if block 8 was never offered as a hit unfilled."""
    prefiller, decoder = servers["p1"], servers["d1"]
    gen = torch.Generator().manual_seed(13)
    first = torch.randint(10, 800, (161,), generator=gen).tolist()
    second = first[:144] + torch.randint(10, 800, (20,), generator=gen).tolist()
    _, cached, _ = _pd(prefiller, decoder, first)
    assert cached == 160
    resp = decode(decoder, second, None, MAX_TOKENS)
    assert resp.status_code == 200, resp.text
    llm = LLM(str(tiny_gemma3), kv_cache_bytes=5 << 20, max_num_batched_tokens=64, enforce_eager=True)
    try:
        expected = llm.generate([second], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    finally:
        llm.engine.shutdown()
    body = resp.json()
    hit = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert body["choices"][0]["text"] == expected[0].outputs[0].text, f"prefix hit of {hit} tokens"
    assert hit == 0  # block 8 was let go unfilled, so no hit reaches into it
    wait_idle(decoder)
    wait_idle(prefiller)


def test_registration_is_one_region_per_distinct_tensor(
    tiny_gemma3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a real engine with the NIXL connector: Gemma 3's 6 layers live in 2 tensors, and
    exactly 2 regions reach NIXL (the real registration, observed on its way)."""
    from kvferry.connector.nixl.agent import Agent

    registered: list[int] = []
    real_register = Agent.register

    def observe(self: Agent, regions: list) -> None:
        registered.append(len(regions))
        real_register(self, regions)

    monkeypatch.setattr(Agent, "register", observe)
    kv = KVTransferConfig("NixlConnector", kv_role="producer")
    llm = make_llm(tiny_gemma3, kv_transfer=kv, enforce_eager=True)
    try:
        config = llm.engine.scheduler.kv_cache_manager.config
        assert len(config.tensors) == 2 and sum(len(t.shared_by) for t in config.tensors) == 6
        assert registered == [len(config.tensors)]
    finally:
        llm.engine.shutdown()


# ---- Gemma 4: KV-shared layers, full layers with wider heads (sliding pages padded) ----

GEMMA4_PAGE = BLOCK * 2 * 32 * 4 * 2  # every group's block: 2 KV heads stored as 32 floats, K and V
GEMMA4_SLIDING_GROUPS = 4  # layers 0, 1, 3, 4; the full group is layer 2; layers 5-7 own no KV


@pytest.fixture(scope="module")
def gemma4_servers(
    tiny_gemma4: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    specs = {name: spec for name, spec in tp_matrix(CHUNK).items() if name != "p2"}
    with serving(tiny_gemma4, tmp_path_factory.mktemp("pd_gemma4"), specs) as started:
        yield started


@pytest.fixture(scope="module")
def gemma4_reference(tiny_gemma4: Path, prompts: list) -> list[str]:
    llm = LLM(str(tiny_gemma4), kv_cache_bytes=5 << 20, max_num_batched_tokens=64, enforce_eager=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("decode_name", ["d1", "d2"])
def test_gemma4_pd_equals_colocated(gemma4_servers, prompts, gemma4_reference, decode_name) -> None:
    """TP (1,1), and (1,2) with the decoder converting NHD to HND (padded heads included)."""
    prefiller, decoder = gemma4_servers["p1"], gemma4_servers[decode_name]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: _pd(prefiller, decoder, p), prompts))
    for prompt, (text, cached, params), expected in zip(prompts, results, gemma4_reference, strict=True):
        assert text == expected, prompt
        assert cached == params["remote_num_tokens"] - 1
    wait_idle(decoder)
    wait_idle(prefiller)


def _gemma4_visible_bytes(num_loaded: int) -> int:
    """The full group's every block and each sliding group's window-visible blocks, one
    (padded) page each: the KV-shared layers add nothing (their source's KV is read once)."""
    full = -(-num_loaded // BLOCK)
    sliding = full - max(0, num_loaded - WINDOW + 1) // BLOCK
    return (full + GEMMA4_SLIDING_GROUPS * sliding) * GEMMA4_PAGE


def test_gemma4_decoder_reads_each_window_and_shared_layers_once(gemma4_servers) -> None:
    prefiller, decoder = gemma4_servers["p1"], gemma4_servers["d1"]
    gen = torch.Generator().manual_seed(12)
    for length in (40, 73, 200, 161):
        prompt = torch.randint(10, 800, (length,), generator=gen).tolist()
        before = decoder.metrics().get("kv_connector_nixl_bytes_read", 0.0)
        _, cached, _ = _pd(prefiller, decoder, prompt)
        read = decoder.metrics()["kv_connector_nixl_bytes_read"] - before
        assert cached == length - 1 and read == _gemma4_visible_bytes(length - 1), (length, read)
    wait_idle(decoder)
    wait_idle(prefiller)


def test_a_decoder_with_other_kv_groups_refuses_naming_the_difference(
    servers, gemma4_servers, prompts
) -> None:
    """Gemma 3's prefill handed to a Gemma 4 decoder: HTTP 400 naming how the groups differ;
    the decoder keeps serving and the prefill stays held for the right decoder (then freed)."""
    prompt = prompts[3]
    params = prefill(servers["p1"], prompt)
    resp = decode(gemma4_servers["d1"], prompt, params, MAX_TOKENS)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "3 KV cache groups there, 5 here" in message, message
    wait_idle(gemma4_servers["d1"])
    _pd(gemma4_servers["p1"], gemma4_servers["d1"], prompt)  # still serving
    assert decode(servers["d1"], prompt, params, MAX_TOKENS).status_code == 200
    for server in (*servers.values(), *gemma4_servers.values()):
        wait_idle(server)


def test_group_difference_names_the_window() -> None:
    from kvferry.connector.nixl.protocol import GroupInfo
    from kvferry.connector.nixl.validate import group_difference

    def groups(window: int) -> list[GroupInfo]:
        return [
            GroupInfo("sliding", 16, 2, 32, "float32", window, ["a"]),
            GroupInfo("full", 16, 2, 32, "float32", 0, ["b"]),
        ]

    assert group_difference(groups(10), groups(10)) is None
    assert group_difference(groups(10), groups(12)) == "KV cache group 0: sliding window 10 there, 12 here"
    one_kv_head = [GroupInfo("sliding", 16, 1, 32, "float32", 10, ["a"]), groups(10)[1]]
    assert group_difference(groups(10), one_kv_head) is None  # another TP size: fine


def test_gemma4_registration_is_one_region_per_distinct_tensor(
    tiny_gemma4: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a real engine with the NIXL connector: the 5 layers owning KV (of 8) in 1 tensor,
    1 region registered; the KV-shared layers are in none."""
    from kvferry.connector.nixl.agent import Agent

    registered: list[int] = []
    real_register = Agent.register

    def observe(self: Agent, regions: list) -> None:
        registered.append(len(regions))
        real_register(self, regions)

    monkeypatch.setattr(Agent, "register", observe)
    kv = KVTransferConfig("NixlConnector", kv_role="producer")
    llm = make_llm(tiny_gemma4, kv_transfer=kv, enforce_eager=True)
    try:
        config = llm.engine.scheduler.kv_cache_manager.config
        layers = [name for t in config.tensors for name in t.shared_by]
        assert len(layers) == 5 and not any(f"layers.{i}." in name for name in layers for i in (5, 6, 7))
        assert registered == [len(config.tensors)] == [1]
    finally:
        llm.engine.shutdown()
