"""Decode failover over real processes: a prefill and two decode `kvferry serve` instances
(NIXL) behind a `kvferry proxy`. The decoder that is answering is SIGKILLed mid-answer;
the proxy continues the answer on the other decoder (from the token ids already sent,
for a stream), so the greedy answer equals the undisturbed one byte for byte, the
proxy's failover counter is 1, and the surviving instances end with every block free."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvferry.entrypoints.proxy.failover import SentTokens
from tests.test_pd_support import Server, kill, nixl, start_server, stop, wait_healthy, wait_idle
from tests.test_proxy_fakes import free_port, start_cli
from tests.test_proxy_fakes import stop as stop_procs
from tests.test_proxy_fakes import wait_healthy as wait_proc_healthy

PROMPT = "The cat sees a small bird and"
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def deployment(tiny_llama: Path, tmp_path: Path) -> Iterator[dict]:
    servers = {
        "prefill": start_server(tiny_llama, tmp_path, "prefill", nixl("producer", unknown_grace_s=1.0)),
        "a": start_server(tiny_llama, tmp_path, "a", nixl("consumer", "recompute")),
        "b": start_server(tiny_llama, tmp_path, "b", nixl("consumer", "recompute")),
    }
    port = free_port()
    args = ["--log-level", "WARNING", "proxy", "--prefill", servers["prefill"].url, "--decode"]
    args += [servers["a"].url, servers["b"].url, "--port", str(port), "--health-interval", "0.5"]
    proxy = start_cli(args, tmp_path / "proxy.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(list(servers.values()))
        wait_proc_healthy(proxy, url, tmp_path / "proxy.log")
        yield {"servers": servers, "proxy": url}
    finally:
        stop_procs([proxy])
        stop(list(servers.values()))


def _answer(url: str, stream: bool) -> str:
    if not stream:
        resp = httpx.post(url + "/v1/completions", json=BODY, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]
    text = []
    with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                assert "token_ids" not in chunk["choices"][0]  # not asked for: not sent
                text.append(chunk["choices"][0]["text"])
    return "".join(text)


def _busy_decoder(servers: dict[str, Server], timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in ("a", "b"):
            if servers[name].metrics()["num_requests_running"] > 0:
                return name
        time.sleep(0.005)
    raise AssertionError("no decoder started the request")


def _failovers(url: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvferry_proxy:decode_failovers_total"):
            total += float(line.rpartition(" ")[2])
    return total


@pytest.mark.parametrize("stream", [True, False])
def test_killed_decoder_answer_continues_on_the_other(deployment: dict, stream: bool) -> None:
    servers, url = deployment["servers"], deployment["proxy"]
    undisturbed = _answer(url, stream)
    for name in ("a", "b"):
        wait_idle(servers[name])
    result: dict[str, str] = {}
    client = threading.Thread(target=lambda: result.update(text=_answer(url, stream)))
    client.start()
    victim = _busy_decoder(servers)
    kill(servers[victim])
    client.join(120)
    assert result.get("text") == undisturbed
    assert _failovers(url) == 1
    survivor = "b" if victim == "a" else "a"
    wait_idle(servers[survivor])
    wait_idle(servers["prefill"])


def test_resume_body_continues_from_the_sent_token_ids() -> None:
    sent = SentTokens()
    first = {"choices": [{"text": "a", "token_ids": [7], "prompt_token_ids": [1, 2, 3]}]}
    sent.record(first, keep_ids=False)
    sent.record({"choices": [{"text": "b", "token_ids": [8, 9]}]}, keep_ids=False)
    assert "token_ids" not in first["choices"][0] and "prompt_token_ids" not in first["choices"][0]
    body = {"prompt": "x y z", "max_tokens": 10, "kv_transfer_params": {"remote_request_id": "r"}}
    resumed = sent.resume_body(body)
    assert resumed["prompt"] == [1, 2, 3, 7, 8, 9] and resumed["max_tokens"] == 7
    assert "kv_transfer_params" not in resumed and resumed["return_token_ids"] is True
    # the second decoder names its longer prompt; a second failover still starts from the first's
    sent.record({"choices": [{"text": "c", "token_ids": [4], "prompt_token_ids": [1, 2, 3, 7, 8, 9]}]}, False)
    assert sent.resume_body(body)["prompt"] == [1, 2, 3, 7, 8, 9, 4]
    usage = {"usage": {"prompt_tokens": 7, "completion_tokens": 2}}
    sent.fix_usage(usage)
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 6}


def test_resume_before_any_chunk_sends_the_request_again() -> None:
    body = {"prompt": "x y z", "max_tokens": 10, "kv_transfer_params": {"remote_request_id": "r"}}
    assert SentTokens().resume_body(body) == {"prompt": "x y z", "max_tokens": 10, "return_token_ids": True}
