"""Side-channel messages (ZMQ + msgspec) between decoders and a prefiller's workers.

Every prefill worker (TP rank) serves its own side channel. A client (a decode worker,
or a decoder's scheduler half) talks to it over a DEALER socket; every request carries a
``seq`` that the reply echoes.

    Handshake  -> EngineInfo   the engine's layout, regions and agents (every rank's)
    Check      -> CheckReply   is this prefill still held, with these blocks? (extends the lease)
    Heartbeat                  extend the leases of these prefills (no reply)
    Done       -> Ack          "rank r finished reading": ACK iff the blocks were still held
    Release                    the decoder will not read: free the blocks now (no reply)

Before any of these, each connection proves the shared secret (auth.py):

    Hello      -> Challenge    the server's nonce and its proof of the secret
    Auth                       the client's proof (no reply; its messages follow at once)
    (anything unauthenticated) -> Refused

A client sends two frames, [session token, message]: the token is empty until Auth.
"""

from __future__ import annotations

import enum
import logging

import msgspec

logger = logging.getLogger(__name__)


class CheckStatus(str, enum.Enum):
    """A prefill rank's answer to Check (CheckReply.status; sent as its value)."""

    HELD = "held"
    UNKNOWN = "unknown"  # never held here (forged, or the prefill has not finished yet)
    EXPIRED = "expired"  # held once; the lease expired or the blocks were released
    MISMATCH = "mismatch"  # held, but not with these blocks / tokens


# The members by their short names.
HELD = CheckStatus.HELD
UNKNOWN = CheckStatus.UNKNOWN
EXPIRED = CheckStatus.EXPIRED
MISMATCH = CheckStatus.MISMATCH


class LayerRegion(msgspec.Struct, frozen=True):
    """One layer's KV tensor on one rank: K blocks from base, V blocks after capacity blocks."""

    name: str
    base: int
    capacity: int  # blocks the tensor has room for (>= num_blocks)


class GroupKind(str, enum.Enum):
    """A KV cache group's attention (GroupInfo.kind; sent as its value)."""

    FULL = "full"
    SLIDING = "sliding"

    def __str__(self) -> str:
        return self.value


class GroupInfo(msgspec.Struct, frozen=True):
    kind: GroupKind
    block_size: int
    kv_heads: int  # per rank
    head_size: int
    dtype: str
    sliding_window: int
    layer_names: list[str]


class RankInfo(msgspec.Struct, frozen=True):
    rank: int
    host: str
    port: int
    agent_name: str
    agent_metadata: bytes
    layers: list[LayerRegion]
    kv_head_start: int  # global index of the first KV head this rank holds
    kv_heads: int


class EngineInfo(msgspec.Struct, frozen=True):
    engine_id: str
    compat_hash: str  # model, dtype, KV heads, head size, layers
    tp_size: int
    block_size: int
    num_blocks: int
    layout: str  # "NHD" | "HND"
    total_kv_heads: int
    lease_s: float
    groups: list[GroupInfo]
    ranks: list[RankInfo]


class Handshake(msgspec.Struct, tag="handshake"):
    seq: int


class Check(msgspec.Struct, tag="check"):
    seq: int
    request_id: str
    block_ids: list[list[int]]
    num_tokens: int
    token_hash: str


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    seq: int
    request_ids: list[str]


class Done(msgspec.Struct, tag="done"):
    seq: int
    request_id: str
    consumer_id: str  # the decode engine
    consumer_rank: int
    consumer_tp: int
    ok: bool  # False: the read failed or was abandoned (counts as done, no ACK expected)


class Release(msgspec.Struct, tag="release"):
    seq: int
    request_id: str


class Hello(msgspec.Struct, tag="hello"):
    seq: int
    nonce: bytes


class Auth(msgspec.Struct, tag="auth"):
    seq: int
    engine_id: str
    proof: bytes


class Challenge(msgspec.Struct, tag="challenge"):
    seq: int
    nonce: bytes
    engine_id: str
    proof: bytes


class Refused(msgspec.Struct, tag="refused"):
    seq: int
    reason: str


class HandshakeReply(msgspec.Struct, tag="handshake_reply"):
    seq: int
    info: EngineInfo | None = None
    error: str | None = None


class CheckReply(msgspec.Struct, tag="check_reply"):
    seq: int
    status: CheckStatus
    message: str = ""
    lease_s: float = 0.0


class Ack(msgspec.Struct, tag="ack"):
    seq: int
    ok: bool
    message: str = ""


ClientMessage = Hello | Auth | Handshake | Check | Heartbeat | Done | Release
ServerMessage = Challenge | Refused | HandshakeReply | CheckReply | Ack


class Codec:
    """Encoder and decoders for one socket owner (one thread)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._client: msgspec.msgpack.Decoder[ClientMessage] = msgspec.msgpack.Decoder(ClientMessage)
        self._server: msgspec.msgpack.Decoder[ServerMessage] = msgspec.msgpack.Decoder(ServerMessage)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode_client(self, payload: bytes) -> ClientMessage | None:
        """A request to a side channel, or None (logged) when it does not decode."""
        try:
            return self._client.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("undecodable side-channel request dropped: %s", exc)
            return None

    def decode_server(self, payload: bytes) -> ServerMessage | None:
        try:
            return self._server.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("undecodable side-channel reply dropped: %s", exc)
            return None
