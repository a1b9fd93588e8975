"""Side-channel authentication in one process: a Server and Clients over real ZMQ sockets."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from kvferry.connector.nixl.auth import PeerAuth, load_secret, new_nonce
from kvferry.connector.nixl.channel import Clients, Inbound, Server
from kvferry.connector.nixl.metadata import NixlSettings
from kvferry.connector.nixl.protocol import (
    Ack,
    Challenge,
    Codec,
    Done,
    Handshake,
    Hello,
    Refused,
    Release,
    Sealed,
)
from kvferry.connector.nixl.sealing import Opener, Sealer, SealError
from kvferry.errors import ConfigError

SECRET = b"s" * 32


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _serve(server: Server, clients: Clients, until, timeout: float = 5.0) -> list[Inbound]:
    """Pump both ends (answering each request with an Ack) until `until()` holds."""
    seen: list[Inbound] = []
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out"
        for inbound in server.receive():
            seen.append(inbound)
            server.reply(inbound.identity, Ack(inbound.message.seq, True))
        clients.receive()
        time.sleep(0.005)
    return seen


def test_an_authenticated_client_is_served_and_knows_who_answered(ctx: zmq.Context) -> None:
    server = Server(ctx, "127.0.0.1", 0, zmq.Poller(), PeerAuth(SECRET, "prefill"))
    clients = Clients(ctx, zmq.Poller(), PeerAuth(SECRET, "decode"), 5.0)
    address = ("127.0.0.1", server.port)
    first = clients.send(address, Handshake(clients.next_seq()), 5.0)
    second = clients.send(address, Done(clients.next_seq(), "r", "decode", 0, 1, True), 5.0)
    seen = _serve(server, clients, lambda: first.done and second.done)
    assert isinstance(first.reply, Ack) and isinstance(second.reply, Ack)
    assert first.peer == "prefill"
    assert [i.peer for i in seen] == ["decode", "decode"]
    assert server.gate.counts.refused == server.gate.counts.failed == 0
    assert clients.num_connects == 1


@pytest.mark.parametrize("client_secret", [b"t" * 32, b""])
def test_another_secret_is_refused_both_ways(ctx: zmq.Context, client_secret: bytes) -> None:
    server = Server(ctx, "127.0.0.1", 0, zmq.Poller(), PeerAuth(SECRET, "prefill"))
    clients = Clients(ctx, zmq.Poller(), PeerAuth(client_secret, "decode"), 5.0)
    pending = clients.send(("127.0.0.1", server.port), Handshake(clients.next_seq()), 5.0)
    seen = _serve(server, clients, lambda: pending.done)
    assert not seen and pending.reply is None
    assert "did not prove the shared secret" in pending.error


def test_a_forged_address_costs_one_connection_attempt(ctx: zmq.Context) -> None:
    clients = Clients(ctx, zmq.Poller(), PeerAuth(SECRET, "decode"), 0.5)
    with zmq.Context() as other:  # a port nobody listens on
        sock = other.socket(zmq.ROUTER)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        sock.close(linger=0)
    pending = clients.send(("127.0.0.1", port), Handshake(clients.next_seq()), 5.0)
    deadline = time.monotonic() + 5
    while not pending.done:
        assert time.monotonic() < deadline
        clients.receive()
        time.sleep(0.01)
    assert "no authenticated answer" in pending.error
    assert clients.num_connects == 1 and not clients.links


def test_release_without_a_session_is_refused(ctx: zmq.Context) -> None:
    server = Server(ctx, "127.0.0.1", 0, zmq.Poller(), PeerAuth(SECRET, "prefill"))
    raw = ctx.socket(zmq.DEALER)
    raw.connect(f"tcp://127.0.0.1:{server.port}")
    raw.send_multipart([b"token?", server.codec.encode(Release(1, "r"))])
    raw.send(server.codec.encode(Release(2, "r")))
    deadline = time.monotonic() + 5
    while server.gate.counts.refused < 2:
        assert time.monotonic() < deadline
        assert server.receive() == []
        time.sleep(0.005)
    raw.close(linger=0)


def test_session_keys_are_bound_to_secret_nonces_and_direction() -> None:
    auth = PeerAuth(SECRET, "x")
    keys = auth.session(b"a", b"b")
    assert keys == PeerAuth(SECRET, "another engine").session(b"a", b"b")  # no engine id in them
    assert keys != auth.session(b"b", b"a") and keys != PeerAuth(b"t" * 32, "x").session(b"a", b"b")
    assert auth.session(b"ab", b"") != auth.session(b"a", b"b")  # the fields are length-prefixed
    values = [keys.server_proof, *vars(keys.to_server).values(), *vars(keys.to_client).values()]
    assert len(set(values)) == 5
    assert "s" * 16 not in repr(auth) and keys.server_proof.hex() not in repr(keys)


def test_sealed_messages_open_once_in_order_and_unaltered() -> None:
    keys = PeerAuth(SECRET, "x").session(new_nonce(), new_nonce())
    sealer, opener = Sealer(keys.to_server), Opener(keys.to_server)
    sealed = [sealer.seal(b"message %d" % i) for i in range(4)]
    assert all(b"message" not in box for _, box in sealed)
    assert opener.open(*sealed[0]) == b"message 0"
    with pytest.raises(SealError, match="not above"):
        opener.open(*sealed[0])  # replayed
    assert opener.open(*sealed[2]) == b"message 2"  # a gap (a dropped message) is allowed
    with pytest.raises(SealError, match="not above"):
        opener.open(*sealed[1])  # reordered
    counter, box = sealed[3]
    for forged in (bytes([box[0] ^ 1]) + box[1:], box[:-1], b""):
        with pytest.raises(SealError):
            opener.open(counter, forged)
    with pytest.raises(SealError):  # the same counter and bytes, the other direction
        Opener(keys.to_client).open(counter, box)
    with pytest.raises(SealError):  # another connection's keys
        Opener(PeerAuth(SECRET, "x").session(new_nonce(), new_nonce()).to_server).open(counter, box)
    assert opener.open(counter, box) == b"message 3"


def test_hello_reveals_no_engine_and_clear_requests_are_refused(ctx: zmq.Context) -> None:
    server = Server(ctx, "127.0.0.1", 0, zmq.Poller(), PeerAuth(SECRET, "prefill-engine-id"))
    raw = ctx.socket(zmq.DEALER)
    raw.connect(f"tcp://127.0.0.1:{server.port}")
    codec = Codec()
    replies = []
    for message in (Hello(1, new_nonce()), Handshake(2), Sealed(0, b"x" * 64)):
        raw.send(codec.encode(message))
        deadline = time.monotonic() + 5
        while not raw.poll(10):
            assert time.monotonic() < deadline
            assert server.receive() == []
        replies.append(raw.recv())
    assert all(b"prefill-engine-id" not in reply for reply in replies)
    challenge, clear, forged = (codec.server_frame(r) for r in replies)
    assert isinstance(challenge, Challenge) and set(challenge.__struct_fields__) == {"seq", "nonce", "proof"}
    assert isinstance(clear, Refused) and clear.seq == 2
    assert isinstance(forged, Refused)  # a sealed Auth that did not open: no session
    assert server.gate.counts.failed == 1 and not server.gate.sessions
    raw.close(linger=0)


def test_secret_sources(tmp_path) -> None:
    path = tmp_path / "secret"
    path.write_text("file-secret-0123456789\n")
    env = {"KVFERRY_KV_SECRET": "env-secret-0123456789"}
    assert load_secret(str(path), env) == b"file-secret-0123456789"
    assert load_secret(None, env) == b"env-secret-0123456789"
    assert load_secret(None, {}) is None
    with pytest.raises(ConfigError, match="shorter"):
        load_secret(None, {"KVFERRY_KV_SECRET": "short"})
    with pytest.raises(ConfigError, match="cannot read"):
        load_secret(str(tmp_path / "missing"), {})


def test_allow_list() -> None:
    settings = NixlSettings.from_extra({"engine_id": "d", "allowed_remotes": ["10.0.0.1", "10.0.0.2:5600"]})
    assert settings.allows("10.0.0.1", 1) and settings.allows("10.0.0.2", 5600)
    assert not settings.allows("10.0.0.2", 5601) and not settings.allows("127.0.0.1", 5600)
    assert NixlSettings.from_extra({"engine_id": "d"}).allows("anywhere", 1)
    with pytest.raises(ConfigError, match="allowed_remotes"):
        NixlSettings.from_extra({"engine_id": "d", "allowed_remotes": "10.0.0.1"})


def test_a_restarted_peer_is_reached_on_a_fresh_connection(ctx: zmq.Context) -> None:
    server = Server(ctx, "127.0.0.1", 0, zmq.Poller(), PeerAuth(SECRET, "prefill"))
    clients = Clients(ctx, zmq.Poller(), PeerAuth(SECRET, "decode"), 5.0)
    address = ("127.0.0.1", server.port)
    first = clients.send(address, Handshake(clients.next_seq()), 5.0)
    _serve(server, clients, lambda: first.done)
    server.close()
    time.sleep(0.2)  # the client's connection learns that its peer is gone
    server = Server(ctx, "127.0.0.1", address[1], zmq.Poller(), PeerAuth(SECRET, "prefill-2"))
    again = clients.send(address, Handshake(clients.next_seq()), 5.0)
    _serve(server, clients, lambda: again.done)
    assert isinstance(again.reply, Ack) and again.peer == "prefill-2"
    assert clients.num_connects == 2
