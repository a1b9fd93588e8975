"""The NixlConnector's scheduler half: holds for decoders, loads from prefillers.

Prefill side: `request_finished` of a request that asked for remote decode keeps its
blocks (delay free), queues a Hold for the workers (whose side channels run the lease)
and returns the kv_transfer_params the proxy hands the decoder. `release_kept` (the
proxy's client left before a decoder got the params) ends the leases at once.

Decode side, per request pointing to a remote prefill:

    handshake (once per remote engine) -> validate the params against it (HTTP 400)
    -> Check with every prefill rank (still held? same blocks, same prompt?) -> ready
    -> async load of the blocks beyond the local prefix hit -> spent

A streamed (layer-wise) remote prefill asks rank 0 for its Progress instead of a Check,
until the prefiller holds it (blocks, token count and prompt hash come with that answer,
and are checked as params would be); its load then reads each layer as it becomes final,
and the first token arrives with the load's result (KVConnectorOutput.remote_first_tokens).
Prefill side, streams.py says when a streamed prefill is held.

Until the answers are in, `get_num_new_matched_tokens` defers the request (None). The
prefiller's first token (`first_token_id`) becomes the request's forced first token: the
decoder outputs it whatever it samples, so its answer continues what the proxy streamed. Sockets
are polled without blocking, whenever the scheduler calls in; while any request waits the
engine keeps stepping, so replies are picked up within a step. Waiting requests' leases
get heartbeats.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from dataclasses import dataclass, field

import zmq

from kvferry.config import EngineConfig, KVRole
from kvferry.connector.nixl.auth import PeerAuth
from kvferry.connector.nixl.channel import Address, Clients, Pending
from kvferry.connector.nixl.leases import Finish, Hold
from kvferry.connector.nixl.metadata import LoadSpec, NixlConnectorMetadata, NixlSettings
from kvferry.connector.nixl.params import (
    RemotePrefill,
    parse_remote_prefill,
    transfer_id_of,
    wants_remote_decode,
)
from kvferry.connector.nixl.protocol import (
    EXPIRED,
    HELD,
    UNKNOWN,
    Check,
    CheckReply,
    EngineInfo,
    Handshake,
    HandshakeReply,
    Heartbeat,
    Progress,
    ProgressReply,
    Release,
)
from kvferry.connector.nixl.regions import compat_hash, group_infos, token_hash
from kvferry.connector.nixl.streams import PrefillStreams
from kvferry.connector.nixl.validate import blocks_to_read, check_remote, null_block
from kvferry.errors import InvalidRequestError
from kvferry.kv.spec import KVCacheConfig
from kvferry.messages.kv_connector import KVTransferParams
from kvferry.messages.scheduler_output import SchedulerOutput
from kvferry.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)

MAX_ENGINES = 256  # remote engines whose handshake is cached
PROGRESS_WAIT_S = 1.0  # a Progress may wait this long on the prefiller for news
NORMAL_FINISH = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class Stage(enum.Enum):
    """Where a decode request's remote KV is (DecodeState.stage)."""

    HANDSHAKE = "handshake"  # waiting for the prefiller's side channel to describe its engine
    CHECK = "check"  # asking every prefill rank whether it still holds the blocks
    STREAM = "stream"  # a streamed prefill: asking rank 0 until it holds the prefill
    READY = "ready"  # held: the scheduler may admit the request with the remote tokens
    LOADING = "loading"  # the workers read the blocks
    SPENT = "spent"  # loaded, failed or released: nothing more to do remotely


@dataclass
class DecodeState:
    request: Request
    remote: RemotePrefill
    stage: Stage = Stage.HANDSHAKE
    info: EngineInfo | None = None
    checks: list[Pending] = field(default_factory=list)
    invalid: str | None = None  # the params do not check out: HTTP 400
    failure: str | None = None  # the remote KV cannot be had: load failure policy
    lease_s: float = 0.0
    num_computed: int = 0
    progress: Pending | None = None  # STREAM: the Progress under way
    arrived: float = field(default_factory=time.monotonic)

    @property
    def engine(self) -> EngineInfo:
        """The remote engine as its handshake described it: known from the CHECK stage on."""
        assert self.info is not None, f"no handshake yet at stage {self.stage.value}"
        return self.info


class NixlScheduler:
    def __init__(
        self,
        engine_config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        settings: NixlSettings,
        auth: PeerAuth,
    ):
        self.config = engine_config
        self.kv_config = kv_cache_config
        self.settings = settings
        self.role = engine_config.kv_transfer.kv_role
        self.block_size = kv_cache_config.block_size
        self.compat = compat_hash(engine_config.model, kv_cache_config)
        self.groups = group_infos(kv_cache_config)
        self.ctx = zmq.Context()
        self.clients = Clients(self.ctx, zmq.Poller(), auth, settings.handshake_timeout_s)
        self.engines: dict[Address, EngineInfo] = {}
        self.handshakes: dict[Address, Pending] = {}
        self.unreachable: dict[Address, tuple[float, str]] = {}  # failed handshakes, until when
        self.decodes: dict[str, DecodeState] = {}
        self.holds: list[Hold] = []
        self.loads: list[LoadSpec] = []
        self.cancels: list[str] = []
        self.releases: list[str] = []
        self.streams = PrefillStreams()
        self.finishes: list[Finish] = []
        self.forgotten: list[tuple[str, str]] = []
        self._last_heartbeat = time.monotonic()

    # ---- decode side ------------------------------------------------------------------

    def request_added(self, request: Request) -> None:
        """Start the handshake and the Check at arrival: the answers (and the heartbeats that
        keep the prefill's lease alive) need not wait for the request's turn."""
        if self.role is not KVRole.CONSUMER:
            self.streams.add(request)
        try:
            self._state(request)
        except InvalidRequestError:
            pass  # reported when the scheduler asks for the request's hits

    def _state(self, request: Request) -> DecodeState | None:
        state = self.decodes.get(request.req_id)
        if state is None:
            remote = parse_remote_prefill(request.kv_transfer_params)
            if remote is None or self.role is KVRole.PRODUCER:
                return None
            state = self.decodes[request.req_id] = DecodeState(request, remote)
            self._force_first_token(state)
            self._advance(state)
        return state

    def _force_first_token(self, state: DecodeState) -> None:
        """The decoder's first token is the prefiller's (the proxy may have streamed it already)."""
        token = state.remote.first_token_id
        if token is None:
            return
        vocab_size = self.config.model.vocab_size
        if token >= vocab_size:
            state.invalid = (
                f"kv_transfer_params: first_token_id {token} is outside the model's vocabulary "
                f"[0, {vocab_size})"
            )
            return
        state.request.force_first_token(token)

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        state = self._state(request)
        if state is None:
            return 0, False
        self._advance(state)
        if state.invalid is not None:
            del self.decodes[request.req_id]
            raise InvalidRequestError(state.invalid, param="kv_transfer_params")
        if state.stage in (Stage.HANDSHAKE, Stage.CHECK, Stage.STREAM):
            return None, False
        if state.stage is not Stage.READY:
            return 0, False  # spent: loaded (or failed) once; a recomputation computes locally
        num = state.remote.num_tokens - num_computed
        if num <= 0:
            self._release(state)
            return 0, False
        state.num_computed = num_computed
        return num, True

    def _advance(self, state: DecodeState) -> None:
        self.clients.receive()
        if state.stage is Stage.HANDSHAKE and state.invalid is None:
            info = self._engine_info(state)
            if info is None:
                return
            state.info = info
            if state.remote.streamed:
                self._send_progress(state)
                return
            state.invalid = check_remote(state.remote, info, self, state.request.num_prompt_tokens)
            if state.invalid is None:
                self._send_checks(state)
        if state.stage is Stage.CHECK and all(p.done for p in state.checks):
            self._check_results(state)
        if state.stage is Stage.STREAM and state.progress is not None and state.progress.done:
            self._progress_result(state, state.progress)

    def _send_progress(self, state: DecodeState) -> None:
        rank = state.engine.ranks[0]
        msg = Progress(self.clients.next_seq(), state.remote.request_id, -1, PROGRESS_WAIT_S)
        timeout = PROGRESS_WAIT_S + self.settings.handshake_timeout_s
        state.progress = self.clients.send((rank.host, rank.port), msg, timeout)
        state.stage = Stage.STREAM

    def _progress_result(self, state: DecodeState, pending: Pending) -> None:
        """Rank 0's answer about a streamed prefill: held (-> READY), not yet, or failed."""
        reply = pending.reply
        state.progress = None
        if isinstance(reply, ProgressReply) and reply.status is HELD:
            self._stream_held(state, reply)
            return
        waited = time.monotonic() - state.arrived
        if (
            isinstance(reply, ProgressReply)
            and reply.status is UNKNOWN
            and waited < self.settings.stream_wait_s
        ):
            self._send_progress(state)  # not started there yet
            return
        if isinstance(reply, ProgressReply) and reply.status is UNKNOWN:
            state.failure = f"the prefill was not held within {self.settings.stream_wait_s:.0f} s"
        elif isinstance(reply, ProgressReply):
            state.failure = reply.message
        else:
            state.failure = f"the prefill engine did not answer: {pending.error or 'bad reply'}"
        logger.warning("streamed KV of %s cannot be loaded: %s", state.remote.request_id, state.failure)
        # The load reports the failure (policy), as for a whole prefill, over the tokens the
        # prefill would have held.
        state.remote = dataclasses.replace(state.remote, num_tokens=state.request.num_prompt_tokens)
        state.stage = Stage.READY

    def _stream_held(self, state: DecodeState, reply: ProgressReply) -> None:
        """The prefiller holds the prefill: check what it holds as params would be checked."""
        prompt = state.request.prompt_token_ids
        if reply.num_tokens > len(prompt) or reply.token_hash != token_hash(prompt[: reply.num_tokens]):
            state.invalid = "kv_transfer_params: the prompt does not match the tokens the prefill computes"
            return
        state.remote = dataclasses.replace(
            state.remote, block_ids=tuple(tuple(ids) for ids in reply.block_ids), num_tokens=reply.num_tokens
        )
        state.invalid = check_remote(state.remote, state.engine, self, state.request.num_prompt_tokens)
        state.lease_s = reply.lease_s
        state.stage = Stage.READY

    def _engine_info(self, state: DecodeState) -> EngineInfo | None:
        """The remote engine's handshake, once per address; None while it is under way."""
        address = (state.remote.host, state.remote.port)
        info = self.engines.get(address)
        if info is not None and info.engine_id == state.remote.engine_id:
            return info  # (another engine id: the engine there may have restarted; ask again)
        if not self.settings.allows(*address):
            state.invalid = (
                f"kv_transfer_params: {address[0]}:{address[1]} is not an allowed prefill side channel "
                "(allowed_remotes)"
            )
            return None
        pending = self.handshakes.get(address)
        if pending is None:
            failed = self.unreachable.get(address)
            if failed is not None and failed[0] > time.monotonic():
                state.invalid = failed[1]  # it just failed: do not wait for another timeout
                return None
            msg = Handshake(self.clients.next_seq())
            self.handshakes[address] = self.clients.send(address, msg, self.settings.handshake_timeout_s)
            return None
        if not pending.done:
            return None
        del self.handshakes[address]
        reply = pending.reply
        if (
            isinstance(reply, HandshakeReply)
            and reply.info is not None
            and reply.info.engine_id == pending.peer
        ):
            if len(self.engines) >= MAX_ENGINES:
                self.engines.pop(next(iter(self.engines)))
            self.engines[address] = reply.info
            return reply.info
        why = pending.error or (reply.error if isinstance(reply, HandshakeReply) else None)
        if why is None and isinstance(reply, HandshakeReply) and reply.info is not None:
            why = f"it describes engine {reply.info.engine_id!r}, it authenticated as {pending.peer!r}"
        state.invalid = f"kv_transfer_params: cannot reach the remote engine at {address[0]}:{address[1]}: {why or 'bad reply'}"
        now = time.monotonic()
        self.unreachable = {a: f for a, f in self.unreachable.items() if f[0] > now}
        self.unreachable[address] = (now + self.settings.handshake_timeout_s, state.invalid)
        return None

    def _send_checks(self, state: DecodeState) -> None:
        remote = state.remote
        digest = token_hash(state.request.prompt_token_ids[: remote.num_tokens])
        block_ids = [list(ids) for ids in remote.block_ids]
        for rank in state.engine.ranks:
            msg = Check(self.clients.next_seq(), remote.request_id, block_ids, remote.num_tokens, digest)
            state.checks.append(
                self.clients.send((rank.host, rank.port), msg, self.settings.handshake_timeout_s)
            )
        state.stage = Stage.CHECK

    def _check_results(self, state: DecodeState) -> None:
        for pending in state.checks:
            reply = pending.reply
            if not isinstance(reply, CheckReply):
                state.failure = f"the prefill engine did not answer: {pending.error or 'bad reply'}"
            elif reply.status is EXPIRED:
                state.failure = reply.message
            elif reply.status is not HELD:
                state.invalid = f"kv_transfer_params: {reply.message}"
                return
            else:
                state.lease_s = reply.lease_s
        state.checks = []
        state.stage = Stage.READY
        if state.failure is not None:
            logger.warning("remote KV of %s cannot be loaded: %s", state.remote.request_id, state.failure)
            self._send_releases(state)  # given up: a late Check must not keep the blocks held

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external: int
    ) -> None:
        state = self.decodes.get(request.req_id)
        if state is None or state.stage is not Stage.READY:
            return
        if num_external <= 0:
            self._release(state)
            return
        groups = (
            ()
            if state.failure is not None and state.remote.streamed
            else blocks_to_read(
                self.groups,
                block_ids,
                state.remote.block_ids,
                state.num_computed,
                state.num_computed + num_external,
                null_block(state.engine.groups),
            )
        )
        remote = state.remote
        self.loads.append(
            LoadSpec(
                request.req_id,
                remote.engine_id,
                remote.host,
                remote.port,
                remote.request_id,
                tuple(groups),
                state.failure,
                remote.streamed,
            )
        )
        state.stage = Stage.LOADING

    def _release(self, state: DecodeState) -> None:
        """Tell every prefill rank the decoder will not read (frees its blocks early)."""
        if state.info is not None and state.stage in (Stage.CHECK, Stage.READY):
            self._send_releases(state)
        state.stage = Stage.SPENT

    def _send_releases(self, state: DecodeState) -> None:
        for rank in state.engine.ranks:
            msg = Release(self.clients.next_seq(), state.remote.request_id)
            self.clients.send((rank.host, rank.port), msg, None)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        waiting: dict[Address, list[str]] = {}
        interval = None
        for state in self.decodes.values():
            if (
                state.stage in (Stage.READY, Stage.LOADING)
                and state.info is not None
                and state.failure is None
            ):
                every = (
                    self.settings.heartbeat_s if self.settings.heartbeat_s is not None else state.lease_s / 3
                )
                interval = every if interval is None else min(interval, every)
                for rank in state.info.ranks:
                    waiting.setdefault((rank.host, rank.port), []).append(state.remote.request_id)
        if not waiting or not interval or now - self._last_heartbeat < interval:
            return
        self._last_heartbeat = now
        for address, request_ids in waiting.items():
            self.clients.send(address, Heartbeat(self.clients.next_seq(), request_ids), None)

    # ---- both sides -------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlConnectorMetadata:
        for state in self.decodes.values():
            if state.stage in (Stage.HANDSHAKE, Stage.CHECK, Stage.STREAM):
                self._advance(state)  # requests still waiting for their turn
        self.clients.receive()
        self._heartbeat()
        streams = []
        for stream in self.streams.completing(scheduler_output):
            hold, _ = self._hold_of(
                stream.request, tuple(stream.block_ids), stream.transfer_id, streamed=True
            )
            self.holds.append(hold)
            streams.append(stream.request.req_id)
        meta = NixlConnectorMetadata(
            self.holds, self.loads, self.cancels, self.releases, streams, self.finishes, self.forgotten
        )
        self.holds, self.loads, self.cancels, self.releases = [], [], [], []
        self.finishes, self.forgotten = [], []
        return meta

    def force_first_tokens(self, tokens: dict[str, int]) -> None:
        """Streamed prefills' first tokens, as the loads received them."""
        for req_id, token in tokens.items():
            state = self.decodes.get(req_id)
            if state is None or state.request.num_output_tokens:
                continue
            if not 0 <= token < self.config.model.vocab_size:
                logger.warning(
                    "request %s: the prefiller's first token %d is outside the vocabulary", req_id, token
                )
                continue
            state.request.force_first_token(token)

    def update_connector_output(self, finished_recving: set[str], failed_recving: set[str]) -> None:
        for req_id in finished_recving:
            state = self.decodes.get(req_id)
            if state is None:
                continue
            if req_id in failed_recving and state.stage is Stage.LOADING:
                self._send_releases(state)  # every rank is done and the load failed: free them now
            state.stage = Stage.SPENT

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, KVTransferParams | None]:
        state = self.decodes.pop(request.req_id, None)
        if state is not None:
            if state.stage is Stage.LOADING:
                self.cancels.append(request.req_id)  # the worker reports it once its reads are over
            else:
                self._release(state)
        if self.role is KVRole.CONSUMER or not wants_remote_decode(request.kv_transfer_params):
            return False, None
        stream = self.streams.pop(request.req_id)
        if stream is not None and stream.held:
            return self._end_stream(request, block_ids)
        if stream is not None and request.status not in NORMAL_FINISH:
            self.forgotten.append(
                (stream.transfer_id, f"the prefill ended before it was computed ({request.status.name})")
            )
        return self._hold(request, block_ids)

    def _end_stream(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, KVTransferParams | None]:
        """A streamed prefill's end: final (first token), or released. Its blocks stay kept
        until the lease ends either way: a decoder may be reading them."""
        if request.status not in NORMAL_FINISH:
            self.releases.append(request.req_id)
            return True, None
        first = request.output_token_ids[0] if request.output_token_ids else None
        self.finishes.append(Finish(request.req_id, first))
        _, params = self._hold_of(
            request, block_ids, transfer_id_of(request.kv_transfer_params), streamed=True
        )
        return True, params

    def release_kept(self, request_ids: list[str]) -> None:
        """Prefill side: end these holds' leases (every worker frees; unknown ids are ignored).
        A hold still queued goes out in the same metadata, and workers apply holds first."""
        if self.role is not KVRole.CONSUMER:
            self.releases.extend(request_ids)

    def _hold(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, KVTransferParams | None]:
        num_tokens = request.num_prompt_tokens
        if request.status not in NORMAL_FINISH or request.num_computed_tokens < num_tokens:
            return False, None
        transfer_id = transfer_id_of(request.kv_transfer_params)
        hold, params = self._hold_of(request, block_ids, transfer_id, streamed=False)
        self.holds.append(hold)
        return True, params

    def _hold_of(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        transfer_id: str | None,
        streamed: bool,
    ) -> tuple[Hold, KVTransferParams]:
        """The hold of a prefill's blocks, and the params a decoder reads them with."""
        num_tokens = request.num_prompt_tokens
        num_blocks = -(-num_tokens // self.block_size)
        held = tuple(tuple(ids[:num_blocks]) for ids in block_ids)
        lease_s = self.settings.lease_s
        expiry = time.time() + lease_s
        digest = token_hash(request.prompt_token_ids)
        hold = Hold(request.req_id, held, num_tokens, digest, lease_s, expiry, transfer_id, streamed)
        first = request.output_token_ids[0] if request.output_token_ids else None
        remote = RemotePrefill(
            engine_id=self.settings.engine_id,
            host=self.settings.side_channel_host,
            port=self.settings.side_channel_port,
            block_ids=held,
            request_id=request.req_id,
            num_tokens=num_tokens,
            tp_size=self.config.parallel.tensor_parallel_size,
            lease_expiry=expiry,
            first_token_id=first,
        )
        return hold, remote.to_params()

    def shutdown(self) -> None:
        self.clients.close()
        self.ctx.term()
