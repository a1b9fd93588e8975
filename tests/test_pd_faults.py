"""P/D faults over real processes and real NIXL agents: leases, heartbeats, kills, aborts.

    prefill    producer, lease 2 s
    victim     producer, killed mid-test
    fail       consumer, policy fail, one request at a time (requests queue)
    recompute  consumer, policy recompute
    slow       consumer, recompute, no heartbeats, waits 4 s between its READ and Done
               (longer than the lease); killed at the end

Whatever happens, output is never corrupt (error or byte-identical to the colocated
engine) and every surviving pool ends all free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams
from tests import plain_http
from tests.pd_support import (
    Server,
    decode,
    kill,
    nixl,
    prefill,
    start_server,
    stop,
    wait_healthy,
    wait_idle,
)

# slow: five `kvferry serve` processes, kills and lease timeouts (make test-all only)
pytestmark = pytest.mark.slow

MAX_TOKENS = 12
LEASE_S = 2.0
PROMPTS = [
    "the cat sees a small bird",
    "a dog sees the red ball in the morning",
    "my friend builds a long road near the house every day and the teacher reads a book",
    "the queen writes a letter to the king because it is late",
    "our team finds a bright star " * 6,
    "hello there",
]


@pytest.fixture(scope="module")
def killed() -> set[str]:
    return set()


@pytest.fixture(scope="module")
def servers(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, killed: set[str]
) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("pd_faults")
    fast = {"handshake_timeout_s": 2.0, "ack_timeout_s": 2.0}
    specs = {
        "prefill": nixl("producer", lease_s=LEASE_S, unknown_grace_s=1.0),
        "victim": nixl("producer"),
        "fail": nixl("consumer", "fail", **fast),
        "recompute": nixl("consumer", "recompute", **fast),
        "slow": nixl("consumer", "recompute", heartbeat_s=0, fault_done_delay_s=4.0, **fast),
    }
    args = {"fail": ("--max-num-seqs", "1")}
    started = {
        name: start_server(tiny_llama, logs, name, kv, args=args.get(name, ())) for name, kv in specs.items()
    }
    try:
        wait_healthy(list(started.values()))
        yield started
    finally:
        codes = dict(zip(started, stop(list(started.values())), strict=True))
    assert all(code == 0 for name, code in codes.items() if name not in killed), {
        name: started[name].tail() for name, code in codes.items() if code != 0
    }


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, servers: dict) -> dict[str, str]:
    llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20, enforce_eager=True)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}


def _metric(server: Server, name: str) -> float:
    return server.metrics().get("kv_connector_" + name, 0.0)


def _ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except Exception as exc:  # the caller inspects it
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _hog(server: Server, stop_event: threading.Event) -> None:
    """A long streamed request that goes away (client disconnect) once stop_event is set."""
    body = {"model": "tiny", "prompt": "the old man", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with plain_http.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as resp:
        for _ in resp.iter_lines():
            if stop_event.is_set():
                return


def test_heartbeats_keep_a_queued_request_lease(servers, reference):
    """The decoder runs one request at a time: a P/D request queued behind two long ones
    waits longer than the prefill's lease, and still gets its KV (heartbeats)."""
    prefiller, decoder = servers["prefill"], servers["fail"]
    expired = _metric(prefiller, "nixl_expired_leases")
    stop_hogs = threading.Event()
    hogs = [_in_thread(_hog, decoder, stop_hogs) for _ in range(2)]
    _wait_for(lambda: decoder.metrics()["num_requests_waiting"] >= 1, 30, "the queue to form")
    prompt = PROMPTS[2]
    params = prefill(prefiller, prompt)
    start = time.monotonic()
    thread, box = _in_thread(decode, decoder, prompt, params, MAX_TOKENS)
    time.sleep(LEASE_S + 1.5)
    stop_hogs.set()
    thread.join(60)
    waited = time.monotonic() - start
    for hog, _ in hogs:
        hog.join(60)
    body = _ok(box["result"])
    assert waited > LEASE_S + 1, f"the request waited only {waited:.1f} s: the test proves nothing"
    assert body["choices"][0]["text"] == reference[prompt]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == params["remote_num_tokens"] - 1
    assert _metric(prefiller, "nixl_expired_leases") == expired
    wait_idle(decoder)
    wait_idle(prefiller)


def test_lease_shorter_than_the_transfer_never_corrupts(servers, reference):
    """The slow decoder acknowledges after the lease ended: every read is refused (NACK),
    the decoder recomputes, and the output is still exactly right."""
    prefiller, decoder = servers["prefill"], servers["slow"]
    expired = _metric(prefiller, "nixl_expired_leases")
    failed = _metric(decoder, "nixl_failed_transfers")
    prompts = PROMPTS[:4]
    jobs = [
        _in_thread(lambda p: (p, _ok(decode(decoder, p, prefill(prefiller, p), MAX_TOKENS))), p)
        for p in prompts
    ]
    for thread, box in jobs:
        thread.join(60)
        prompt, body = box["result"]
        assert body["choices"][0]["text"] == reference[prompt]
    assert _metric(prefiller, "nixl_expired_leases") == expired + len(prompts)
    assert _metric(decoder, "nixl_failed_transfers") == failed + len(prompts)
    wait_idle(decoder)
    wait_idle(prefiller)


def test_client_abort_while_loading_releases_both_sides(servers):
    prefiller, decoder = servers["prefill"], servers["slow"]
    expired = _metric(prefiller, "nixl_expired_leases")
    prompt = PROMPTS[1]
    params = prefill(prefiller, prompt)
    with pytest.raises(httpx.ReadTimeout):
        decoder.post({"prompt": prompt, "max_tokens": MAX_TOKENS, "kv_transfer_params": params}, timeout=0.5)
    wait_idle(decoder)
    wait_idle(prefiller)
    assert _metric(prefiller, "nixl_expired_leases") == expired  # released by the decoder


def test_prefiller_killed(servers, reference, killed):
    """Before its decoders read (policy: error, or recompute) and between a READ and its
    acknowledgement (recompute). The decoders keep serving."""
    victim, failing, recomputing, slow = (
        servers["victim"],
        servers["fail"],
        servers["recompute"],
        servers["slow"],
    )
    for decoder in (failing, recomputing):  # the decoders know the victim (handshake cached)
        prompt = PROMPTS[0]
        assert (
            _ok(decode(decoder, prompt, prefill(victim, prompt)))["choices"][0]["text"] == reference[prompt]
        )
    a, b, c = PROMPTS[3], PROMPTS[4], PROMPTS[5]
    params = {p: prefill(victim, p) for p in (a, b, c)}
    read_before = _metric(slow, "nixl_bytes_read")
    thread, box = _in_thread(decode, slow, c, params[c], MAX_TOKENS)
    _wait_for(lambda: _metric(slow, "nixl_bytes_read") > read_before, 30, "the slow decoder's READ")
    kill(victim)
    killed.add("victim")
    resp = decode(failing, a, params[a], MAX_TOKENS)
    assert resp.status_code == 500, resp.text
    assert "KV" in resp.json()["error"]["message"]
    assert _ok(decode(recomputing, b, params[b], MAX_TOKENS))["choices"][0]["text"] == reference[b]
    thread.join(60)
    assert _ok(box["result"])["choices"][0]["text"] == reference[c]  # no ACK: recomputed
    for decoder in (failing, recomputing):  # still serving, P/D included
        prompt = PROMPTS[1]
        params = prefill(servers["prefill"], prompt)
        assert _ok(decode(decoder, prompt, params, MAX_TOKENS))["choices"][0]["text"] == reference[prompt]
    for server in (failing, recomputing, slow, servers["prefill"]):
        wait_idle(server)


def test_decoder_killed_mid_transfer(servers, killed):
    """The decoder dies between its READ and its Done: the blocks come back at lease end."""
    prefiller, decoder = servers["prefill"], servers["slow"]
    expired = _metric(prefiller, "nixl_expired_leases")
    read_before = _metric(decoder, "nixl_bytes_read")
    prompt = PROMPTS[2]
    params = prefill(prefiller, prompt)
    _in_thread(decode, decoder, prompt, params, MAX_TOKENS)
    _wait_for(lambda: _metric(decoder, "nixl_bytes_read") > read_before, 30, "the decoder's READ")
    assert prefiller.metrics()["num_free_blocks"] < prefiller.metrics()["num_blocks"]  # held
    kill(decoder)
    killed.add("slow")
    wait_idle(prefiller, timeout=LEASE_S + 10)
    assert _metric(prefiller, "nixl_expired_leases") == expired + 1
