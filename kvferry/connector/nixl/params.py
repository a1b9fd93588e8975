"""The kv_transfer_params contract between prefiller, proxy and decoder.

Prefill request (proxy -> prefiller): ``{"do_remote_decode": true}``.

Prefill response (prefiller -> proxy), and decode request (proxy -> decoder, with the
original prompt):

    {
      "do_remote_prefill": true,
      "remote_engine_id": str,          # the prefiller's engine id
      "remote_host": str,               # its side channel (TP rank 0)
      "remote_port": int,
      "remote_block_ids": [[int]],      # one list per KV cache group
      "remote_request_id": str,         # the prefill request's id
      "remote_num_tokens": int,         # prompt tokens whose KV the blocks hold
      "remote_tp_size": int,
      "lease_expiry": float,            # unix time; the decoder's heartbeats extend it
      "first_token_id": int             # the prefiller's first token; the decoder's first too
    }

Layer-wise (a streamed prefill): the proxy names the transfer itself and sends both
requests at once, so that the decoder reads each layer's KV while the prefill computes
the next ones. Prefill request: ``{"do_remote_decode": true, "transfer_id": str}``;
decode request (no block ids yet: the prefiller's side channel tells them, and which
layers are final, as the prefill runs; its acknowledgement carries the first token):

    {
      "do_remote_prefill": true,
      "remote_engine_id": str, "remote_host": str, "remote_port": int, "remote_tp_size": int,
      "remote_transfer_id": str         # the prefill request's transfer_id
    }

Types are checked here, synchronously, in the front end (HTTP 400); ranges are checked
by the scheduler half against the prefiller's handshake (and first_token_id against the
model's vocabulary).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeGuard

from kvferry.config import KVRole
from kvferry.errors import InvalidRequestError
from kvferry.messages.kv_connector import KVTransferParams

logger = logging.getLogger(__name__)

PARAM = "kv_transfer_params"
MAX_ID_LEN = 256


def _fail(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"kv_transfer_params: {message}", param=PARAM)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _flag(params: KVTransferParams, key: str) -> bool:
    value = params.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _fail(f"{key} must be a boolean")
    return value


@dataclass(frozen=True)
class RemotePrefill:
    """A decode request's pointer to KV a prefiller holds for it."""

    engine_id: str
    host: str
    port: int
    block_ids: tuple[tuple[int, ...], ...]
    request_id: str
    num_tokens: int
    tp_size: int
    lease_expiry: float | None = None
    first_token_id: int | None = None
    streamed: bool = False  # request_id is a transfer id; block ids and tokens come from the prefiller

    def to_params(self) -> KVTransferParams:
        return {
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": [list(ids) for ids in self.block_ids],
            "remote_request_id": self.request_id,
            "remote_num_tokens": self.num_tokens,
            "remote_tp_size": self.tp_size,
            "lease_expiry": self.lease_expiry,
            "first_token_id": self.first_token_id,
        }


def wants_remote_decode(params: KVTransferParams | None) -> bool:
    """Whether a (validated) request asks this engine to hold its KV for a decoder."""
    return params is not None and params.get("do_remote_decode") is True


def transfer_id_of(params: KVTransferParams | None) -> str | None:
    """A (validated) remote-decode request's transfer id: a decoder streams its layers."""
    if not wants_remote_decode(params):
        return None
    assert params is not None
    return _string(params, "transfer_id") if params.get("transfer_id") is not None else None


def _string(params: KVTransferParams, key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LEN:
        raise _fail(f"{key} must be a non-empty string")
    return value


def _positive_int(params: KVTransferParams, key: str, upper: int) -> int:
    value = params.get(key)
    if not _is_int(value) or not 0 < value <= upper:
        raise _fail(f"{key} must be an integer in [1, {upper}]")
    return value


def _block_ids(params: KVTransferParams) -> tuple[tuple[int, ...], ...]:
    value = params.get("remote_block_ids")
    if not isinstance(value, list) or not value:
        raise _fail("remote_block_ids must be a non-empty list (one list of block ids per KV cache group)")
    groups = []
    for group in value:
        if not isinstance(group, list) or not all(_is_int(b) and b >= 0 for b in group):
            raise _fail("remote_block_ids must hold lists of non-negative integers")
        groups.append(tuple(group))
    return tuple(groups)


def _optional_number(params: KVTransferParams, key: str) -> float | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(f"{key} must be a number")
    return float(value)


def parse_remote_prefill(params: KVTransferParams | None) -> RemotePrefill | None:
    """The remote prefill a decode request points to, None if it points to none.

    Raises InvalidRequestError for malformed parameters.
    """
    if params is None:
        return None
    if not isinstance(params, dict):
        raise _fail("must be a JSON object")
    if not _flag(params, "do_remote_prefill"):
        return None
    if params.get("remote_transfer_id") is not None:
        return _remote_stream(params)
    first = params.get("first_token_id")
    if first is not None and not (_is_int(first) and first >= 0):
        raise _fail("first_token_id must be a non-negative integer")
    return RemotePrefill(
        engine_id=_string(params, "remote_engine_id"),
        host=_string(params, "remote_host"),
        port=_positive_int(params, "remote_port", 65535),
        block_ids=_block_ids(params),
        request_id=_string(params, "remote_request_id"),
        num_tokens=_positive_int(params, "remote_num_tokens", 1 << 30),
        tp_size=_positive_int(params, "remote_tp_size", 1024),
        lease_expiry=_optional_number(params, "lease_expiry"),
        first_token_id=first,
    )


def _remote_stream(params: KVTransferParams) -> RemotePrefill:
    """A decode request's pointer to a streamed prefill (what the prefiller holds comes later)."""
    return RemotePrefill(
        engine_id=_string(params, "remote_engine_id"),
        host=_string(params, "remote_host"),
        port=_positive_int(params, "remote_port", 65535),
        block_ids=(),
        request_id=_string(params, "remote_transfer_id"),
        num_tokens=0,
        tp_size=_positive_int(params, "remote_tp_size", 1024),
        streamed=True,
    )


def validate_params(kv_role: KVRole, params: KVTransferParams | None) -> None:
    """The front end's synchronous check: types, and what this instance's role can do."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise _fail("must be a JSON object")
    remote_decode = _flag(params, "do_remote_decode")
    remote_prefill = parse_remote_prefill(params) is not None
    if params.get("transfer_id") is not None:
        if not remote_decode:
            raise _fail("transfer_id needs do_remote_decode")
        transfer_id_of(params)
    if remote_decode and kv_role is KVRole.CONSUMER:
        raise _fail("do_remote_decode needs a prefill instance (kv_role producer or both)")
    if remote_prefill and kv_role is KVRole.PRODUCER:
        raise _fail("do_remote_prefill needs a decode instance (kv_role consumer or both)")
