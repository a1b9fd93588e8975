"""A relay between a decoder and a prefiller's side channel learns nothing it could use.

    prefill   producer, secret S
    decode    consumer, secret S, allowed_remotes ["127.0.0.1"] (lets the relay's port
              through: what is shown here is what the channel itself protects)
    relay     a real TCP forwarder process (tests/tcp_relay.py) to the prefiller's side
              channel, recording every byte

A request whose kv_transfer_params point the decoder at the relay (with the engine id the
attacker learned) makes the decoder authenticate and handshake through it. Before the
channel was sealed the relay read the handshake reply (NIXL agent metadata, KV region
addresses) in the clear and a plain NIXL READ returned another request's KV. Now the
recording holds no engine id, agent name, agent metadata or handshake reply, and a NIXL
agent fed every frame the relay saw loads none of them: there is nothing to READ with.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zmq

from kvferry.connector.nixl.agent import Agent, NixlError, TransferState
from kvferry.connector.nixl.auth import PeerAuth
from kvferry.connector.nixl.channel import Clients
from kvferry.connector.nixl.plan import ReadPlan
from kvferry.connector.nixl.protocol import EngineInfo, Handshake, HandshakeReply
from kvferry.connector.nixl.regions import Region
from tests.pd_support import (
    ROOT,
    Server,
    decode,
    nixl,
    prefill,
    start_server,
    stop,
    wait_healthy,
    wait_idle,
)

PROMPT = "the queen writes a letter to the king because it is late"
ZMTP_GREETING_BYTES = 64
STOLEN_BYTES = 256

# slow: a prefiller, a decoder and a relay process (make test-all only)
pytestmark = pytest.mark.slow


@dataclass
class Relay:
    proc: subprocess.Popen
    port: int
    record_dir: Path

    def recorded(self) -> dict[str, bytes]:
        """Every connection's bytes, by direction: {"0.up": ..., "0.down": ...}."""
        return {p.name: p.read_bytes() for p in sorted(self.record_dir.iterdir())}


def start_relay(host: str, port: int, record_dir: Path) -> Relay:
    record_dir.mkdir()
    cmd = [sys.executable, "-m", "tests.tcp_relay", host, str(port), str(record_dir)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, cwd=ROOT)
    assert proc.stdout is not None
    return Relay(proc, int(proc.stdout.readline()), record_dir)


@pytest.fixture(scope="module")
def deployment(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server, Path]]:
    logs = tmp_path_factory.mktemp("side_channel_relay")
    secret = logs / "kv-secret"
    secret.write_text(os.urandom(32).hex())
    args = ("--kv-transfer-secret-file", str(secret), "--dtype", "float32")
    pre = start_server(tiny_llama, logs, "prefill", nixl("producer", lease_s=60.0), args=args)
    dec = start_server(tiny_llama, logs, "decode", nixl("consumer", allowed_remotes=["127.0.0.1"]), args=args)
    try:
        wait_healthy([pre, dec], timeout=600)  # a loaded CI host may take minutes
        yield pre, dec, secret
    finally:
        codes = stop([pre, dec])
    assert codes == [0, 0], (pre.tail(), dec.tail())


def zmtp_frames(stream: bytes) -> list[bytes]:
    """The bodies of a ZMTP 3 stream's frames (commands and messages), after the greeting."""
    frames, at = [], ZMTP_GREETING_BYTES
    while at < len(stream):
        flags = stream[at]
        size_bytes = 8 if flags & 0x02 else 1
        size = int.from_bytes(stream[at + 1 : at + 1 + size_bytes], "big")
        start = at + 1 + size_bytes
        frames.append(stream[start : start + size])
        at = start + size
    return frames


def blobs(recorded: dict[str, bytes]) -> list[bytes]:
    """Everything the relay could try to use: each frame, and each bytes value inside one."""
    out: list[bytes] = []
    for stream in recorded.values():
        for frame in zmtp_frames(stream):
            out.append(frame)
            try:
                decoded = msgspec.msgpack.decode(frame)
            except (msgspec.DecodeError, ValueError):  # not msgpack (a ZMTP command, a token)
                continue
            if isinstance(decoded, dict):
                out += [v for v in decoded.values() if isinstance(v, bytes)]
    return out


def handshakes_in(recorded: dict[str, bytes]) -> list[EngineInfo]:
    decoder = msgspec.msgpack.Decoder(HandshakeReply)
    found = []
    for stream in recorded.values():
        for frame in zmtp_frames(stream):
            try:
                reply = decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                continue
            if reply.info is not None:
                found.append(reply.info)
    return found


def legitimate_handshake(secret: Path, host: str, port: int) -> EngineInfo:
    """What the prefiller tells a peer that holds the secret (to know what to look for)."""
    ctx = zmq.Context()
    clients = Clients(ctx, zmq.Poller(), PeerAuth(secret.read_text().encode(), "inspector"), 10.0)
    try:
        pending = clients.send((host, port), Handshake(clients.next_seq()), 10.0)
        while not pending.done:
            clients.receive()
            time.sleep(0.01)
        assert isinstance(pending.reply, HandshakeReply) and pending.reply.info is not None, pending.error
        return pending.reply.info
    finally:
        clients.close()
        ctx.destroy(linger=0)


class Thief:
    """A NIXL agent of the attacker's, with a buffer to READ into."""

    def __init__(self) -> None:
        self.agent = Agent(f"thief-{os.getpid()}")
        self.buffer = torch.zeros(STOLEN_BYTES, dtype=torch.uint8)
        self.agent.register([Region(self.buffer.data_ptr(), STOLEN_BYTES, 0)])

    def steal(self, metadata: bytes, address: int) -> bytes:
        """A plain NIXL READ at `address` of the agent `metadata` describes (NixlError: the
        metadata does not load)."""
        name = self.agent.add_remote(metadata)
        plan = ReadPlan(
            np.array([[self.buffer.data_ptr(), STOLEN_BYTES, 0]], dtype=np.uint64),
            np.array([[address, STOLEN_BYTES, 0]], dtype=np.uint64),
        )
        transfer = self.agent.read(plan, name)
        deadline = time.monotonic() + 20
        while self.agent.poll(transfer) is TransferState.PROC and time.monotonic() < deadline:
            time.sleep(0.01)
        assert transfer.state is TransferState.DONE, transfer.state
        return self.buffer.numpy().tobytes()

    def try_everything(self, recorded: dict[str, bytes], address: int) -> list[bytes]:
        """What READs return with anything the relay recorded: every blob as agent metadata,
        and any handshake reply it could read."""
        stolen = []
        for blob in blobs(recorded):
            try:
                stolen.append(self.steal(blob, address))
            except NixlError:
                pass  # not agent metadata: nothing to READ with
        for found in handshakes_in(recorded):
            stolen.append(self.steal(found.ranks[0].agent_metadata, found.ranks[0].layers[0].base))
        return stolen

    def close(self) -> None:
        self.agent.close()


def test_a_relay_sees_no_secret_and_cannot_read_kv(deployment, tmp_path: Path) -> None:
    pre, dec, secret = deployment
    params = prefill(pre, PROMPT)
    host, port = params["remote_host"], params["remote_port"]
    relay = start_relay(host, port, tmp_path / "recorded")
    try:
        forged = {**params, "remote_host": "127.0.0.1", "remote_port": relay.port}
        resp = decode(dec, PROMPT, forged)  # the decoder authenticates through the relay
        assert resp.status_code == 200, resp.text
        recorded = relay.recorded()
    finally:
        relay.proc.kill()
        relay.proc.wait()
    assert any(name.endswith(".down") and data for name, data in recorded.items()), recorded.keys()
    info = legitimate_handshake(secret, host, port)
    rank = info.ranks[0]
    thief = Thief()
    try:
        stolen = thief.try_everything(recorded, rank.layers[0].base)
    finally:
        thief.close()
    assert stolen == [], "the relay read KV over NIXL"
    assert handshakes_in(recorded) == []
    everything = b"".join(recorded.values())
    for revealing in (
        info.engine_id.encode(),
        rank.agent_name.encode(),
        rank.agent_metadata[: len(rank.agent_metadata) // 2],
        b"agent_metadata",
        b"handshake_reply",
    ):
        assert revealing not in everything, revealing[:40]
    wait_idle(pre)
    wait_idle(dec)
