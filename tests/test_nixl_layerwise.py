"""Layer-wise P/D over NIXL: two engine cores in one process, real NIXL agents.

The decoder gets its request first, naming the prefill by a transfer id (params.py); the
prefiller, configured ``layerwise``, holds the prefill from the step that completes its
prompt and marks each layer's KV final as its forward saves it, so the decoder's READs of
the first layers start while the later layers compute (a fault setting slows each layer
enough to see it). Answers equal a colocated engine's, and every pool ends all free.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.config import (
    KVTransferConfig,
)
from kvferry.engine.core import EngineCore
from kvferry.messages.engine_core import EngineCoreOutput, EngineCoreRequest
from kvferry.ports import free_port
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, tokenize_all
from tests.test_nixl_engine import _config, _drain

LAYER_DELAY_S = 0.2
STREAM_WAIT_S = 3.0


PREFILL_PORT = free_port()
PREFILL_ENGINE = f"lw-{uuid.uuid4().hex[:8]}"


def _prefill_config(layerwise: bool) -> KVTransferConfig:
    extra = {
        "engine_id": PREFILL_ENGINE,
        "side_channel_port": PREFILL_PORT,
        "lease_s": 20,
        "layerwise": layerwise,
        "fault_layer_delay_s": LAYER_DELAY_S,
    }
    return KVTransferConfig("NixlConnector", kv_role="producer", kv_connector_extra_config=extra)


@pytest.fixture(scope="module")
def cores(tiny_qwen2: Path) -> Iterator[dict[str, EngineCore]]:
    consumer = KVTransferConfig(
        "NixlConnector",
        kv_role="consumer",
        kv_load_failure_policy="fail",
        kv_connector_extra_config={"stream_wait_s": STREAM_WAIT_S},
    )
    made = {
        "prefill": EngineCore(_config(tiny_qwen2, _prefill_config(True), "NHD")),
        "decode": EngineCore(_config(tiny_qwen2, consumer, "HND")),
        "colocated": EngineCore(_config(tiny_qwen2, None, "NHD")),
    }
    yield made
    for core in made.values():
        core.shutdown()


def _stream_params(transfer_id: str, engine_id: str = PREFILL_ENGINE, port: int = PREFILL_PORT) -> dict:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_tp_size": 1,
        "remote_transfer_id": transfer_id,
    }


class Stepping:
    """Steps an engine core on a thread of its own (as its own process would), so that its
    forward and the other engine's steps overlap; errors are kept for the test."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Stepping:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.core.has_unfinished_requests():
                time.sleep(0.001)
                continue
            self.errors += [out.error for out in self.core.step() if out.error is not None]


def _run_together(
    decoder: EngineCore, prefiller: EngineCore, requests: list[tuple[EngineCoreRequest, EngineCoreRequest]]
) -> tuple[dict[str, list[int]], dict[str, EngineCoreOutput]]:
    """Add each decode request, then its prefill; step both until every decode finishes."""
    tokens: dict[str, list[int]] = {d.req_id: [] for d, _ in requests}
    finals: dict[str, EngineCoreOutput] = {}
    deadline = time.monotonic() + 60
    with Stepping(prefiller) as stepping:
        for decode, prefill in requests:
            decoder.add_request(decode)
            prefiller.add_request(prefill)
        while len(finals) < len(requests):
            assert time.monotonic() < deadline, "requests did not finish"
            outputs = decoder.step()
            for out in outputs:
                tokens[out.req_id] += out.new_token_ids
                if out.finished:
                    finals[out.req_id] = out
            if not outputs:
                time.sleep(0.002)  # waiting for KV: leave the interpreter to the prefiller's thread
        while prefiller.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not stepping.errors, stepping.errors
    return tokens, finals


def _colocated(
    core: EngineCore, prompts: list[list[int]], params: SamplingParams, tag: str
) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{tag}-c{i}", prompt, params, time.time()))
    tokens: dict[str, list[int]] = {f"{tag}-c{i}": [] for i in range(len(prompts))}
    done = 0
    while done < len(prompts):
        for out in core.step():
            tokens[out.req_id] += out.new_token_ids
            done += out.finished
    return [tokens[f"{tag}-c{i}"] for i in range(len(prompts))]


def _pairs(
    prompts: list[list[int]],
    tag: str,
    transfer_ids: list[str],
    engine_id: str = PREFILL_ENGINE,
    port: int = PREFILL_PORT,
) -> list[tuple[EngineCoreRequest, EngineCoreRequest]]:
    """(decode, prefill) request pairs, each decode pointing to its prefill's transfer id."""
    now = time.time()
    one = SamplingParams(max_tokens=1, temperature=0)
    params = SamplingParams(max_tokens=8, temperature=0)
    return [
        (
            EngineCoreRequest(f"{tag}-d{i}", prompt, params, now, _stream_params(tid, engine_id, port)),
            EngineCoreRequest(
                f"{tag}-p{i}", prompt, one, now, {"do_remote_decode": True, "transfer_id": tid}
            ),
        )
        for i, (prompt, tid) in enumerate(zip(prompts, transfer_ids, strict=True))
    ]


def test_layers_are_read_while_the_prefill_computes_and_answers_match(cores, tiny_qwen2):
    prefiller, decoder = cores["prefill"], cores["decode"]
    prompts = [[7, *p] for p in tokenize_all(tiny_qwen2, PROMPT_TEXTS)]
    _run_together(decoder, prefiller, _pairs([[9, 9, 9]], "warm", [uuid.uuid4().hex]))  # handshakes
    before = decoder.stats().kv_connector
    tids = [uuid.uuid4().hex for _ in prompts]
    decoded, finals = _run_together(decoder, prefiller, _pairs(prompts, "lw", tids))
    expected = _colocated(cores["colocated"], prompts, SamplingParams(max_tokens=8, temperature=0), "lw")
    for i, prompt in enumerate(prompts):
        assert finals[f"lw-d{i}"].error is None, finals[f"lw-d{i}"].error
        assert decoded[f"lw-d{i}"] == expected[i]
        assert finals[f"lw-d{i}"].num_cached_tokens == len(prompt) - 1  # the prompt's KV came over NIXL
    after = decoder.stats().kv_connector
    early = after.get("nixl_layers_read_early", 0) - before.get("nixl_layers_read_early", 0)
    transfers = after["nixl_transfers"] - before.get("nixl_transfers", 0)
    assert early > 0, after  # READs started before the prefill finished
    assert transfers > len(prompts)  # layer by layer, not one READ per prompt
    _drain(prefiller, decoder)


def _decode_alone(decoder: EngineCore, request: EngineCoreRequest, prefiller: EngineCore) -> EngineCoreOutput:
    """Step the decoder (the prefiller on its own thread) until `request` ends; its last output."""
    with Stepping(prefiller):
        decoder.add_request(request)
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, "the request did not end"
            outputs = [out for out in decoder.step() if out.finished]
            if outputs:
                return outputs[0]
            time.sleep(0.002)


def test_a_prefill_that_never_comes_fails_the_load_after_the_wait(cores, tiny_qwen2):
    prefiller, decoder = cores["prefill"], cores["decode"]
    prompt = tokenize_all(tiny_qwen2, PROMPT_TEXTS[:1])[0]
    request = EngineCoreRequest(
        "never-d", prompt, SamplingParams(max_tokens=4), time.time(), _stream_params("nobody")
    )
    start = time.monotonic()
    out = _decode_alone(decoder, request, prefiller)
    assert out.error is not None and "loading the request's KV cache failed" in out.error, out.error
    assert STREAM_WAIT_S <= time.monotonic() - start < STREAM_WAIT_S + 10
    _drain(prefiller, decoder)


def test_an_aborted_prefill_fails_its_decoder_at_once(cores, tiny_qwen2):
    """The prefill ends before its last chunk ran: the transfer id is remembered as gone,
    so the decoder's next question fails its load now, not after the wait."""
    prefiller, decoder = cores["prefill"], cores["decode"]
    prompt = tokenize_all(tiny_qwen2, PROMPT_TEXTS[1:2])[0]
    ((decode, prefill),) = _pairs([prompt], "abort", ["abort-tid"])
    prefiller.add_request(prefill)
    prefiller.abort_requests([prefill.req_id])
    start = time.monotonic()
    out = _decode_alone(decoder, decode, prefiller)
    assert out.error is not None and "loading the request's KV cache failed" in out.error, out.error
    assert time.monotonic() - start < STREAM_WAIT_S
    _drain(prefiller, decoder)


def test_a_transfer_id_of_another_prompt_is_a_client_error(cores, tiny_qwen2):
    """The prefiller holds the transfer for another prompt: the decoder refuses the params
    (HTTP 400 kind) and reads nothing."""
    prefiller, decoder = cores["prefill"], cores["decode"]
    prompts = tokenize_all(tiny_qwen2, PROMPT_TEXTS[2:4])
    ((_, prefill),) = _pairs(prompts[:1], "other", ["other-tid"])
    ((decode, _),) = _pairs(prompts[1:2], "other", ["other-tid"])
    prefiller.add_request(prefill)
    out = _decode_alone(decoder, decode, prefiller)
    assert out.invalid_param == "kv_transfer_params" and "does not match" in out.error, out.error
    prefiller.release_kv([prefill.req_id])  # as the proxy does for a leg no decoder answered
    _drain(prefiller, decoder)
