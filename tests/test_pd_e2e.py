"""P/D end to end: a prefill and two decode `kvferry serve` processes with real NIXL agents.

Every prompt is prefilled (max_tokens=1, do_remote_decode), then decoded with the
returned kv_transfer_params; greedy output must equal a colocated engine's, byte for
byte, with the prompt's KV read over NIXL (not recomputed). One decoder keeps the
prefiller's layout (NHD), the other converts on receive (HND). Bad params get HTTP 400.
Every test ends with every block pool all free.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams
from tests.test_pd_support import (
    Server,
    decode,
    free_port,
    nixl,
    prefill,
    prompt_set,
    start_server,
    stop,
    wait_healthy,
    wait_idle,
)

MAX_TOKENS = 12
CHUNK = ("--max-num-batched-tokens", "64")  # long prompts take several prefill steps


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("pd_e2e")
    started = {
        "prefill": start_server(
            tiny_llama, logs, "prefill", nixl("producer", unknown_grace_s=1.0), args=CHUNK
        ),
        "nhd": start_server(
            tiny_llama, logs, "nhd", nixl("consumer", "fail", handshake_timeout_s=2.0), args=CHUNK
        ),
        "hnd": start_server(tiny_llama, logs, "hnd", nixl("consumer", "recompute"), layout="HND", args=CHUNK),
    }
    try:
        wait_healthy(list(started.values()))
        yield started
    finally:
        codes = stop(list(started.values()))
    assert codes == [0, 0, 0], {s.name: s.tail() for s in started.values()}


@pytest.fixture(scope="module")
def prompts(tiny_llama: Path) -> list[str | list[int]]:
    return prompt_set(AutoTokenizer.from_pretrained(tiny_llama))


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, prompts: list, servers: dict) -> list[str]:
    """The colocated engine's greedy completions (computed while the servers start)."""
    llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [o.outputs[0].text for o in outs]


def _num_tokens(tokenizer, prompt) -> int:
    return len(prompt) if isinstance(prompt, list) else len(tokenizer.encode(prompt))


def _pd(prefiller: Server, decoder: Server, prompt, stream: bool = False) -> dict:
    params = prefill(prefiller, prompt)
    if stream:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        body["kv_transfer_params"] = params
        with httpx.stream(
            "POST", decoder.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60
        ) as r:
            assert r.status_code == 200
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        text = "".join(
            json.loads(c[6:])["choices"][0]["text"] for c in chunks if json.loads(c[6:])["choices"]
        )
        return {"text": text, "params": params, "cached": None}
    resp = decode(decoder, prompt, params, MAX_TOKENS)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return {"text": body["choices"][0]["text"], "params": params, "cached": cached}


@pytest.mark.parametrize("decoder", ["nhd", "hnd"])
def test_pd_output_equals_colocated(servers, prompts, reference, tiny_llama, decoder):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    before = servers[decoder].metrics()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: _pd(servers["prefill"], servers[decoder], p), prompts))
    assert len(prompts) >= 16
    for prompt, result, expected in zip(prompts, results, reference, strict=True):
        assert result["text"] == expected, prompt
        n = _num_tokens(tok, prompt)
        assert result["params"]["remote_num_tokens"] == n
        assert len(result["params"]["remote_block_ids"][0]) == -(-n // 16)
        assert result["cached"] == n - 1  # every prompt token but the last came over NIXL
    after = wait_idle(servers[decoder])
    wait_idle(servers["prefill"])
    # The decoder's own prefix cache serves shared prefixes: not every prompt needs a READ.
    transfers = after["kv_connector_nixl_transfers"] - before.get("kv_connector_nixl_transfers", 0)
    assert len(prompts) // 2 <= transfers < len(prompts)
    assert after["kv_connector_nixl_bytes_read"] > before.get("kv_connector_nixl_bytes_read", 0)


def test_pd_streaming_decode(servers, prompts, reference):
    for i in (0, 6, 9):
        assert _pd(servers["prefill"], servers["nhd"], prompts[i], stream=True)["text"] == reference[i]
    wait_idle(servers["nhd"])
    wait_idle(servers["prefill"])


def test_decode_prefix_cache_reads_only_missing_blocks(servers, prompts, reference):
    decoder = servers["nhd"]
    prompt, expected = prompts[7], reference[7]  # a long prompt: many blocks
    first = _pd(servers["prefill"], decoder, prompt)
    read_once = decoder.metrics()["kv_connector_nixl_bytes_read"]
    second = _pd(servers["prefill"], decoder, prompt)  # full blocks now hit the decoder's cache
    read_twice = decoder.metrics()["kv_connector_nixl_bytes_read"]
    assert first["text"] == second["text"] == expected
    block = 2 * 16 * 2 * 16 * 4 * 3  # K+V, block size, KV heads, head size, float32, layers
    assert read_twice - read_once <= block
    wait_idle(decoder)
    wait_idle(servers["prefill"])


def _bad_cases(servers: dict[str, Server], good: dict, prompt_len: int) -> list[tuple[str, dict]]:
    dead_port = free_port()
    return [
        ("wrong types", {**good, "remote_port": "5555"}),
        ("wrong types", {**good, "remote_block_ids": [[1, "x"]]}),
        ("unknown engine", {**good, "remote_engine_id": "kvf-nobody"}),
        ("out of range", {**good, "remote_block_ids": [[10**6] * len(good["remote_block_ids"][0])]}),
        ("too many blocks", {**good, "remote_block_ids": [good["remote_block_ids"][0] + [3]]}),
        ("more tokens than the prompt", {**good, "remote_num_tokens": prompt_len + 1}),
        ("unreachable peer", {**good, "remote_port": dead_port}),
        ("forged request", {**good, "remote_request_id": "cmpl-forged-0"}),
        ("forged blocks", {**good, "remote_block_ids": [[b + 1 for b in good["remote_block_ids"][0]]]}),
    ]


def test_bad_kv_transfer_params_are_400(servers, prompts, reference):
    decoder, prefiller = servers["nhd"], servers["prefill"]
    prompt = prompts[4]
    good = prefill(prefiller, prompt)
    prompt_len = good["remote_num_tokens"]
    for name, params in _bad_cases(servers, good, prompt_len):
        for stream in (False, True):
            body = {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": params, "stream": stream}
            resp = decoder.post(body)
            assert resp.status_code == 400, (name, stream, resp.text)
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == "kv_transfer_params", error
    other = "the scientist explains the strange machine to a curious student in the kitchen after lunch"
    mismatch = decode(decoder, other[: len(prompt)], good)  # the prompt the prefill did not compute
    assert mismatch.status_code == 400 and "prompt" in mismatch.json()["error"]["message"]
    assert (
        decoder.post({"prompt": prompt, "kv_transfer_params": {"do_remote_decode": True}}).status_code == 400
    )
    assert prefiller.post({"prompt": prompt, "kv_transfer_params": good}).status_code == 400
    wait_idle(decoder)
    # The genuine params still work after all that, and free the prefiller's blocks.
    resp = decode(decoder, prompt, good, MAX_TOKENS)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == reference[4]
    wait_idle(decoder)
    wait_idle(prefiller)


def test_pd_chat(servers, tiny_llama):
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    llm = LLM(str(tiny_llama), kv_cache_bytes=1 << 20)
    expected = llm.chat(messages, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].outputs[0].text
    base = {"model": "tiny", "messages": messages, "temperature": 0}
    first = httpx.post(
        servers["prefill"].url + "/v1/chat/completions",
        json={**base, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=60,
    ).json()
    params = first["kv_transfer_params"]
    body = {**base, "max_tokens": MAX_TOKENS, "kv_transfer_params": params}
    resp = httpx.post(servers["hnd"].url + "/v1/chat/completions", json=body, timeout=60).json()
    assert resp["choices"][0]["message"]["content"] == expected
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] == params["remote_num_tokens"] - 1
    wait_idle(servers["hnd"])
    wait_idle(servers["prefill"])
