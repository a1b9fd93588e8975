"""Side-channel messages (ZMQ + msgspec) between decoders and a prefiller's workers.

Every prefill worker (TP rank) serves its own side channel. A client (a decode worker,
or a decoder's scheduler half) talks to it over a DEALER socket; every request carries a
``seq`` that the reply echoes.

    Handshake  -> EngineInfo   the engine's layout, regions and agents (every rank's)
    Check      -> CheckReply   is this prefill still held, with these blocks? (extends the lease)
    Heartbeat                  extend the leases of these prefills (no reply)
    Done       -> Ack          "rank r finished reading": ACK iff the blocks were still held
    Release                    the decoder will not read: free the blocks now (no reply)
    Progress   -> ProgressReply  a streamed prefill (layer-wise): its blocks, the layers
                               whose KV is final, and at the end its first token; the
                               reply waits (up to `wait_s`) for news past `known_layers`

Before any of these, each connection proves the shared secret and agrees on session keys
(auth.py, sealing.py); only Hello, Challenge and Refused travel in the clear, and they
name no engine:

    Hello      -> Challenge    both nonces, and the server's proof of the secret
    Auth       -> Welcome      sealed: the client's engine id / the server's
    (anything not sealed in an authenticated session) -> Refused

Every other message travels inside a `Sealed` envelope (encrypted and authenticated with
the connection's key for its direction, numbered): one ZMQ frame per message.
"""

from __future__ import annotations

import enum
import logging
from typing import TypeVar

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


class Progress(msgspec.Struct, tag="progress"):
    """Where a streamed prefill is. `request_id` is its transfer id (params.py)."""

    seq: int
    request_id: str
    known_layers: int  # layers the asker already knows final; -1: nothing known yet
    wait_s: float  # answer once there is news, or after this long


class Hello(msgspec.Struct, tag="hello"):
    seq: int
    nonce: bytes


class Auth(msgspec.Struct, tag="auth"):
    """The client's first sealed message: sealing it proves the secret (its key needs it)."""

    seq: int
    engine_id: str


class Challenge(msgspec.Struct, tag="challenge"):
    seq: int
    nonce: bytes
    proof: bytes  # auth.SessionKeys.server_proof: the server knows the secret


class Welcome(msgspec.Struct, tag="welcome"):
    """The server's answer to Auth (sealed): the session is open; who the server is."""

    seq: int
    engine_id: str


class Sealed(msgspec.Struct, tag="sealed"):
    """A message encrypted and authenticated with the session key of its direction."""

    counter: int  # strictly increasing per direction: nothing replayed or reordered
    box: bytes


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


class ProgressReply(msgspec.Struct, tag="progress_reply"):
    seq: int
    status: CheckStatus  # HELD: under way or final; UNKNOWN: not started here (yet)
    message: str = ""
    block_ids: list[list[int]] = []
    num_tokens: int = 0
    token_hash: str = ""
    layers: list[str] = []  # layers whose KV is final, in the order they became so
    final: bool = False  # the prefill finished: every layer is final
    first_token: int | None = None
    lease_s: float = 0.0


class Ack(msgspec.Struct, tag="ack"):
    seq: int
    ok: bool
    message: str = ""
    first_token: int | None = None  # a streamed prefill's first token


# What travels sealed, each way.
ClientMessage = Auth | Handshake | Check | Heartbeat | Done | Release | Progress
ServerMessage = Welcome | HandshakeReply | CheckReply | ProgressReply | Ack
# What a frame may hold: the clear handshake, a sealed message, or (client to server) a
# message sent in the clear by mistake (an old client): refused, with its seq.
ClientFrame = Hello | Sealed | Auth | Handshake | Check | Heartbeat | Done | Release | Progress
ServerFrame = Challenge | Refused | Sealed

M = TypeVar("M")


class Codec:
    """Encoder and decoders for one socket owner (one thread)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._client_frame: msgspec.msgpack.Decoder[ClientFrame] = msgspec.msgpack.Decoder(ClientFrame)
        self._server_frame: msgspec.msgpack.Decoder[ServerFrame] = msgspec.msgpack.Decoder(ServerFrame)
        self._client: msgspec.msgpack.Decoder[ClientMessage] = msgspec.msgpack.Decoder(ClientMessage)
        self._server: msgspec.msgpack.Decoder[ServerMessage] = msgspec.msgpack.Decoder(ServerMessage)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def client_frame(self, payload: bytes) -> ClientFrame | None:
        """A frame sent to a side channel, or None (logged) when it does not decode."""
        return _decode(self._client_frame, payload, "request")

    def server_frame(self, payload: bytes) -> ServerFrame | None:
        return _decode(self._server_frame, payload, "reply")

    def client_message(self, plaintext: bytes) -> ClientMessage | None:
        """A request, opened from its Sealed envelope."""
        return _decode(self._client, plaintext, "sealed request")

    def server_message(self, plaintext: bytes) -> ServerMessage | None:
        return _decode(self._server, plaintext, "sealed reply")


def _decode(decoder: msgspec.msgpack.Decoder[M], payload: bytes, what: str) -> M | None:
    try:
        return decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        logger.warning("undecodable side-channel %s dropped: %s", what, exc)
        return None
