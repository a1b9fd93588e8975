"""P/D end to end: a prefill and two decode `kvferry serve` processes with real NIXL agents.

Every prompt is prefilled (max_tokens=1, do_remote_decode), then decoded with the
returned kv_transfer_params; greedy output must equal a colocated engine's, byte for
byte, with the prompt's KV read over NIXL (not recomputed). One decoder keeps the
prefiller's layout (NHD), the other converts on receive (HND). Bad params get HTTP 400.
Through a `kvferry proxy` (with relays that show what each instance answered), seeded
sampled answers equal a colocated engine's too, and an unseeded sampled stream starts
with the prefiller's token, sent early, which the decoder's answer continues.
Every test ends with every block pool all free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams
from tests import plain_http
from tests.pd_support import (
    Relay,
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
from tests.proxy_fakes import serve_in_thread, start_cli
from tests.proxy_fakes import stop as stop_procs
from tests.proxy_fakes import wait_healthy as wait_proc_healthy

# slow: three compiled `kvferry serve` processes and a proxy (make test-all only)
pytestmark = pytest.mark.slow

MAX_TOKENS = 12
# Long prompts take several prefill steps; decode steps run compiled (not left to the
# start-up measurement, which could choose eager on a noisy host).
CHUNK = ("--max-num-batched-tokens", "64", "--capture", "always")


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("pd_e2e")
    kw = {"args": CHUNK, "log_level": "INFO"}  # INFO: the captured forward's lines
    started = {
        "prefill": start_server(tiny_llama, logs, "prefill", nixl("producer", unknown_grace_s=1.0), **kw),
        "nhd": start_server(tiny_llama, logs, "nhd", nixl("consumer", "fail", handshake_timeout_s=2.0), **kw),
        "hnd": start_server(tiny_llama, logs, "hnd", nixl("consumer", "recompute"), layout="HND", **kw),
    }
    try:
        wait_healthy(list(started.values()))
        yield started
    finally:
        codes = stop(list(started.values()))
    assert codes == [0, 0, 0], {s.name: s.tail() for s in started.values()}
    # Each worker's count at shutdown: the prefiller's warm-up decode ran compiled, and
    # the decoders' real decode steps did too.
    compiled = {s.name: _compiled_forwards(s.log.read_text(errors="replace")) for s in started.values()}
    assert compiled["prefill"] >= 1 and compiled["nhd"] > 1 and compiled["hnd"] > 1, compiled


def _compiled_forwards(log: str) -> int:
    (count,) = re.findall(r"captured forward: (\d+) forwards compiled", log)
    return int(count)


@pytest.fixture(scope="module")
def prompts(tiny_llama: Path) -> list[str | list[int]]:
    return prompt_set(AutoTokenizer.from_pretrained(tiny_llama))


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, prompts: list, servers: dict) -> list[str]:
    """The colocated engine's greedy completions (computed while the servers start)."""
    llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20, max_num_batched_tokens=64, enforce_eager=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [o.outputs[0].text for o in outs]


def _num_tokens(tokenizer, prompt) -> int:
    return len(prompt) if isinstance(prompt, list) else len(tokenizer.encode(prompt))


def _pd(prefiller: Server, decoder: Server, prompt, stream: bool = False) -> dict:
    params = prefill(prefiller, prompt)
    if stream:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        body["kv_transfer_params"] = params
        with plain_http.stream(
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


def test_both_sides_run_the_captured_forward(servers):
    """Each instance compiled its decode program (warm-up's decode step ran it: compiled
    steps > 0) and kept it, with its NIXL connector configured."""
    for server in servers.values():
        log = server.log.read_text(errors="replace")
        assert "captured forward: decode steps compiled in" in log, server.tail()
        assert "captured forward: on (--capture always, not measured)" in log, server.tail()


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
        ("first token outside the vocabulary", {**good, "first_token_id": 10**6}),
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
    llm = LLM(str(tiny_llama), kv_cache_bytes=1 << 20, enforce_eager=True)
    expected = llm.chat(messages, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].outputs[0].text
    base = {"model": "tiny", "messages": messages, "temperature": 0}
    first = plain_http.post(
        servers["prefill"].url + "/v1/chat/completions",
        json={**base, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=60,
    ).json()
    params = first["kv_transfer_params"]
    body = {**base, "max_tokens": MAX_TOKENS, "kv_transfer_params": params}
    resp = plain_http.post(servers["hnd"].url + "/v1/chat/completions", json=body, timeout=60).json()
    assert resp["choices"][0]["message"]["content"] == expected
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] == params["remote_num_tokens"] - 1
    wait_idle(servers["hnd"])
    wait_idle(servers["prefill"])


# ---- through the proxy ---------------------------------------------------------------------

SAMPLED = {"temperature": 0.8, "top_p": 0.9}
MESSAGES = [
    [{"role": "user", "content": "Tell me a story about a cat."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Count from 3 to ten."}],
    [{"role": "user", "content": "the old man reads a golden book by the sea " * 6}],
]


class ProxyDeployment:
    def __init__(self, url: str, prefill: Relay, decode: Relay) -> None:
        self.url = url
        self.prefill = prefill  # what the prefiller answered the proxy, request by request
        self.decode = decode  # the same for the (NHD) decoder

    def stream(self, path: str, body: dict) -> list[dict]:
        """The SSE data objects the client gets."""
        with plain_http.stream("POST", self.url + path, json={"model": "tiny", **body}, timeout=120) as r:
            assert r.status_code == 200, r.read()
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    def completion(self, prompt, max_tokens: int, stream: bool, **params) -> str:
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream, **params}
        if stream:
            return "".join(_texts(self.stream("/v1/completions", body)))
        resp = plain_http.post(self.url + "/v1/completions", json={"model": "tiny", **body}, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def proxy(servers: dict[str, Server], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyDeployment]:
    """`kvferry proxy` in front of the prefiller and the NHD decoder, each behind a Relay."""
    logs = tmp_path_factory.mktemp("pd_proxy")
    relays = Relay(servers["prefill"].url), Relay(servers["nhd"].url)
    with serve_in_thread(relays[0].app) as prefill_url, serve_in_thread(relays[1].app) as decode_url:
        port = free_port()
        args = ["--log-level", "WARNING", "proxy", "--prefill", prefill_url, "--decode", decode_url]
        proc = start_cli([*args, "--port", str(port), "--health-interval", "1"], logs / "proxy.log")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_proc_healthy(proc, url, logs / "proxy.log")
            yield ProxyDeployment(url, *relays)
        finally:
            codes = stop_procs([proc])
        log = (logs / "proxy.log").read_text()
        assert codes == [0], log
        assert "does not start with" not in log and "shorter than" not in log, log  # no divergence


def _texts(chunks: list[dict]) -> list[str]:
    """Each chunk's text (completions) or content (chat); chunks without choices skipped."""
    out = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return out


def test_seeded_sampling_through_the_proxy_equals_colocated(servers, proxy, prompts, tiny_llama):
    """Prefiller and decoder each spend one draw of the seed on the first token: the decoder's
    answer is the colocated engine's, byte for byte, streamed or not."""
    llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20, max_num_batched_tokens=64, enforce_eager=True)
    for seeds, stream in (([7] * len(prompts), False), (range(100, 100 + len(prompts)), True)):
        params = [SamplingParams(max_tokens=MAX_TOKENS, seed=seed, **SAMPLED) for seed in seeds]
        expected = [o.outputs[0].text for o in llm.generate(prompts, params)]

        def one(prompt, seed, stream=stream) -> str:
            return proxy.completion(prompt, MAX_TOKENS, stream, seed=seed, **SAMPLED)

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, prompts, seeds)) == expected
    assert len(set(expected)) > 1
    for seed, messages in enumerate(MESSAGES):
        want = llm.chat(messages, SamplingParams(max_tokens=MAX_TOKENS, seed=seed, **SAMPLED))
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "seed": seed, "stream": True, **SAMPLED}
        assert "".join(_texts(proxy.stream("/v1/chat/completions", body))) == want[0].outputs[0].text
    wait_idle(servers["nhd"])
    wait_idle(servers["prefill"])


def _check_early_first_token(proxy: ProxyDeployment, client_chunks: list[dict]) -> bool:
    """The client's first text is the prefiller's token; the decoder's answer starts with it
    and is, whole, what the client got. Returns whether the token was sent early."""
    prefilled, decoded = proxy.prefill.answers[-1], proxy.decode.answers[-1]
    choice = prefilled["choices"][0]
    first = choice.get("text", (choice.get("message") or {}).get("content")) or ""
    decoder_text = "".join(_texts(decoded))
    client_texts = [t for t in _texts(client_chunks) if t]
    assert decoder_text.startswith(first), (first, decoder_text)
    assert "".join(client_texts) == decoder_text  # nothing doubled, nothing dropped
    early = bool(first) and "\ufffd" not in first
    if early:
        assert client_texts[0] == first
    return early


def test_unseeded_sampled_stream_sends_the_prefill_token_first(servers, proxy, prompts):
    early = 0
    for prompt in prompts[:8]:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, **SAMPLED}
        early += _check_early_first_token(proxy, proxy.stream("/v1/completions", body))
    for messages in MESSAGES:
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "stream": True, **SAMPLED}
        early += _check_early_first_token(proxy, proxy.stream("/v1/chat/completions", body))
    assert early >= 6  # the prefill's token went out before the decoder's stream, mostly
    wait_idle(servers["nhd"])
    wait_idle(servers["prefill"])
