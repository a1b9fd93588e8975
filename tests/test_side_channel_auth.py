"""The NixlConnector's side channel is authenticated (docs/security.md), over real processes.

    prefill    producer, secret A (--kv-transfer-secret-file), lease 60 s
    decode     consumer, secret A, policy fail, allowed_remotes ["127.0.0.1"]
    stranger   consumer, secret B

A raw ZMQ client without the secret gets no handshake, cannot release a lease and cannot
guess its way in; every refusal is counted in the prefiller's /metrics. The decoder with
the secret still reads the KV (byte-identical to a colocated engine); the stranger's
requests fail with a clear 400. A forged remote address fails its request after one
connection attempt; a decoder that gave up on a transfer releases the lease at once.
Every pool ends all free.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from kvferry.connector.nixl.auth import PeerAuth, new_nonce
from kvferry.connector.nixl.protocol import (
    Auth,
    Challenge,
    Codec,
    Handshake,
    HandshakeReply,
    Hello,
    Refused,
    Release,
    Sealed,
)
from kvferry.connector.nixl.sealing import Sealer
from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams
from tests import plain_http
from tests.pd_support import Server, decode, nixl, prefill, start_server, stop, wait_healthy, wait_idle

# slow: several `kvferry serve` processes with NIXL side channels (make test-all only)
pytestmark = pytest.mark.slow

MAX_TOKENS = 12
PROMPTS = [
    "the cat sees a small bird",
    "a dog sees the red ball in the morning",
    "my friend builds a long road near the house every day and the teacher reads a book",
    "the queen writes a letter to the king because it is late",
    "our team finds a bright star " * 6,
]
LEASE_S = 60.0  # far longer than any test waits: held blocks must come back by release
TIMEOUT_S = 3.0  # the decoders' handshake / check timeout
DTYPE = ("--dtype", "float32")  # byte-identical to the colocated reference, whatever auto picks


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("side_channel_auth")
    ours, theirs = logs / "secret-a", logs / "secret-b"
    ours.write_text(os.urandom(32).hex())
    theirs.write_text(os.urandom(32).hex())
    fast = {"handshake_timeout_s": TIMEOUT_S, "ack_timeout_s": TIMEOUT_S}
    specs = {
        "prefill": (nixl("producer", lease_s=LEASE_S, unknown_grace_s=1.0), ours),
        "decode": (nixl("consumer", "fail", allowed_remotes=["127.0.0.1"], **fast), ours),
        "stranger": (nixl("consumer", "fail", **fast), theirs),
    }
    started = {
        name: start_server(
            tiny_llama, logs, name, kv, args=("--kv-transfer-secret-file", str(secret), *DTYPE)
        )
        for name, (kv, secret) in specs.items()
    }
    try:
        wait_healthy(list(started.values()))
        yield started
    finally:
        codes = stop(list(started.values()))
    assert codes == [0, 0, 0], {s.name: s.tail() for s in started.values()}


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, servers: dict) -> dict[str, str]:
    llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20, dtype="float32", enforce_eager=True)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}


def _text(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def _counter(server: Server, name: str) -> float:
    return server.metrics().get("kv_connector_nixl_side_channel_" + name, 0.0)


def _wait_counted(server: Server, timeout: float = 10.0, **at_least: float) -> None:
    """The refusal counters reach /metrics with the prefiller's next step."""
    deadline = time.monotonic() + timeout
    while any(_counter(server, name) < n for name, n in at_least.items()):
        assert time.monotonic() < deadline, server.metrics()
        time.sleep(0.1)


def _held(server: Server) -> float:
    m = server.metrics()
    return m["num_blocks"] - m["num_free_blocks"]


class RawClient:
    """A side-channel client written from the protocol, without the secret."""

    def __init__(self, host: str, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{host}:{port}")
        self.codec = Codec()

    def ask(self, message: msgspec.Struct, token: bytes | None = None) -> object:
        payload = self.codec.encode(message)
        self.sock.send_multipart([payload] if token is None else [token, payload])
        assert self.sock.poll(5000), "the side channel did not answer"
        return self.codec.server_frame(self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_unauthenticated_peers_are_refused_and_counted(servers: dict, reference: dict) -> None:
    pre, dec = servers["prefill"], servers["decode"]
    prompt = PROMPTS[0]
    params = prefill(pre, prompt)
    held = _held(pre)
    assert held > 0
    raw = RawClient(params["remote_host"], params["remote_port"])
    try:
        # the old protocol (one frame, no session), then the new one without a session
        for token in (None, b"", os.urandom(32)):
            reply = raw.ask(Handshake(1), token)
            assert isinstance(reply, Refused) and not isinstance(reply, HandshakeReply), reply
            assert isinstance(raw.ask(Release(2, params["remote_request_id"]), token), Refused)
        # a guessed secret: the challenge names no engine, its proof does not check out, and
        # nothing sealed with the keys the guess gives is answered
        nonce = new_nonce()
        challenge = raw.ask(Hello(3, nonce))
        assert isinstance(challenge, Challenge) and not hasattr(challenge, "engine_id")
        guess = PeerAuth(b"guessed-secret-guessed-secret", "intruder").session(nonce, challenge.nonce)
        assert guess.server_proof != challenge.proof
        sealer = Sealer(guess.to_server)
        for message in (Auth(4, "intruder"), Release(5, params["remote_request_id"])):
            assert isinstance(raw.ask(Sealed(*sealer.seal(raw.codec.encode(message)))), Refused)
    finally:
        raw.close()
    time.sleep(0.5)
    assert _held(pre) == held  # no Release was honoured
    assert _text(decode(dec, prompt, params, MAX_TOKENS)) == reference[prompt]
    assert dec.metrics()["kv_connector_nixl_bytes_read"] > 0  # over NIXL, after the secret was proven
    _wait_counted(pre, refused=6, auth_failed=2)
    wait_idle(pre)
    wait_idle(dec)


def test_a_decoder_with_another_secret_gets_a_clear_error(servers: dict, reference: dict) -> None:
    pre, dec, stranger = servers["prefill"], servers["decode"], servers["stranger"]
    prompt = PROMPTS[1]
    params = prefill(pre, prompt)
    resp = decode(stranger, prompt, params)
    assert resp.status_code == 400, resp.text
    assert "did not prove the shared secret" in resp.json()["error"]["message"]
    assert stranger.metrics().get("kv_connector_nixl_bytes_read", 0.0) == 0
    assert _text(decode(dec, prompt, params)) == reference[prompt]  # the lease is intact
    for server in (pre, dec, stranger):
        wait_idle(server)


class Listener:
    """A TCP port that accepts connections and closes them at once, counting them."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.host, self.port = self.sock.getsockname()
        self.accepted = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


class Impostor:
    """A ZMQ side channel that does not know the secret."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        codec = Codec()
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            frames = self.sock.recv_multipart()
            message = codec.client_frame(frames[-1])
            if isinstance(message, Hello):
                fake = Challenge(message.seq, new_nonce(), os.urandom(32))
                self.sock.send_multipart([frames[0], codec.encode(fake)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


def _forged(params: dict, host: str, port: int) -> dict:
    return {**params, "remote_host": host, "remote_port": port}


def _refused_fast(server: Server, prompt: str, params: dict, expect: str) -> None:
    begin = time.monotonic()
    resp = decode(server, prompt, params)
    assert resp.status_code == 400, resp.text
    assert expect in resp.json()["error"]["message"], resp.text
    assert time.monotonic() - begin < TIMEOUT_S + 5


def test_forged_remote_addresses_fail_their_request_with_bounded_attempts(
    servers: dict, reference: dict
) -> None:
    pre, dec = servers["prefill"], servers["decode"]
    prompt = PROMPTS[2]
    params = prefill(pre, prompt)
    listener = Listener()
    impostor = Impostor()
    try:
        forged = _forged(params, listener.host, listener.port)
        _refused_fast(dec, prompt, forged, "cannot reach the remote engine")
        _refused_fast(dec, prompt, forged, "cannot reach the remote engine")  # remembered
        assert 1 <= listener.accepted <= 2, listener.accepted  # not one per 100 ms
        _refused_fast(dec, prompt, _forged(params, "127.0.0.1", impostor.port), "did not prove")
    finally:
        listener.close()
        impostor.close()
    other = Listener("127.0.0.2")
    try:
        _refused_fast(dec, prompt, _forged(params, "127.0.0.2", other.port), "allowed_remotes")
        assert other.accepted == 0  # never dialled
    finally:
        other.close()
    assert plain_http.get(dec.url + "/health").status_code == 200
    assert _text(decode(dec, prompt, params)) == reference[prompt]  # the engine serves on
    wait_idle(pre)
    wait_idle(dec)


def _signal_group(server: Server, sig: signal.Signals) -> None:
    os.killpg(server.proc.pid, sig)


def test_a_decoder_that_gave_up_releases_the_lease(servers: dict, reference: dict) -> None:
    """The decoder's Check reaches a stopped prefiller, times out and the request fails; when
    the prefiller resumes it reads that Check (which extends the lease by a full term), and
    the decoder's Release that followed: the blocks come back in seconds, not after 60 s."""
    pre, dec = servers["prefill"], servers["decode"]
    warm = PROMPTS[3]
    assert _text(decode(dec, warm, prefill(pre, warm))) == reference[warm]  # handshake cached
    prompt = PROMPTS[4]
    params = prefill(pre, prompt)
    _signal_group(pre, signal.SIGSTOP)
    try:
        resp = decode(dec, prompt, params)
    finally:
        _signal_group(pre, signal.SIGCONT)
    assert resp.status_code != 200, resp.text
    wait_idle(pre, timeout=15.0)
    wait_idle(dec)
    assert _text(decode(dec, warm, prefill(pre, warm))) == reference[warm]
    wait_idle(pre)
