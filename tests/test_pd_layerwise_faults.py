"""Layer-wise P/D faults over real processes: a prefiller killed while its layers stream.

The prefiller (layer-wise, each layer slowed so the forward lasts seconds) is killed once
the decoder has read a layer of the prefill in progress. The decoder's next Progress gets
no answer: the load fails, its READs end (or are given up), and under the `recompute`
policy the decoder computes the prompt itself and answers as a colocated engine does.
Its pool ends all free.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import plain_http
from tests.pd_support import (
    Server,
    colocated_greedy,
    decode,
    kill,
    nixl,
    start_server,
    stop,
    wait_healthy,
    wait_idle,
)

# slow: two `kvferry serve` processes, one killed (make test-all only)
pytestmark = pytest.mark.slow

MAX_TOKENS = 8
PROMPT = " ".join(["the old man reads a golden book by the sea"] * 6)
FAST = {"handshake_timeout_s": 2.0, "ack_timeout_s": 2.0, "transfer_timeout_s": 10.0}


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("pd_layerwise_faults")
    started = {
        "victim": start_server(
            tiny_llama, logs, "victim", nixl("producer", layerwise=True, fault_layer_delay_s=1.0)
        ),
        "recompute": start_server(tiny_llama, logs, "recompute", nixl("consumer", "recompute", **FAST)),
    }
    try:
        wait_healthy(list(started.values()))
        yield started
    finally:
        codes = stop([started["recompute"]])
    assert codes == [0], started["recompute"].tail()


def _early(server: Server) -> float:
    return server.metrics().get("kv_connector_nixl_layers_read_early", 0.0)


def test_a_prefiller_killed_mid_stream_is_recomputed_by_the_decoder(servers, tiny_llama):
    victim, decoder = servers["victim"], servers["recompute"]
    (expected,) = [o.text for o in colocated_greedy(tiny_llama, [PROMPT], MAX_TOKENS)]
    source = plain_http.get(victim.url + "/v1/kv_transfer/source", timeout=10).json()["kv_transfer_params"]
    transfer_id = uuid.uuid4().hex
    box: dict = {}

    def run_decode() -> None:
        box["response"] = decode(decoder, PROMPT, {**source, "remote_transfer_id": transfer_id}, MAX_TOKENS)

    def run_prefill() -> None:
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
        try:
            victim.post(body, timeout=60)
        except Exception as exc:  # killed mid-answer
            box["prefill_error"] = exc

    before = _early(decoder)
    threads = [threading.Thread(target=run_decode), threading.Thread(target=run_prefill)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while _early(decoder) <= before:  # a layer of the prefill in progress was read
        assert time.monotonic() < deadline, "no layer was read while the prefill ran"
        time.sleep(0.05)
    kill(victim)
    for thread in threads:
        thread.join(90)
    response = box["response"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected  # recomputed, never stale KV
    metrics = wait_idle(decoder)
    assert metrics["kv_connector_nixl_failed_transfers"] >= 1
