"""AsyncEngine: the serving front end of one engine core running in its own process.

It owns the tokenizer, the input and output processors and the core client, and one
background task (on the serving event loop) that reads the core's outputs, detokenizes
them and routes each RequestOutput to the queue of the ``generate`` call waiting for it.

    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(out.delta_text, end="")

A consumer that stops iterating (a client disconnect cancels the handler) aborts the
request in the core, which frees its KV blocks. Per-request timing (arrival, first
token, every token) goes to the registered ``StatLogger``s as ``IterationStats``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvferry.config import EngineConfig, ModelConfig
from kvferry.connector.factory import kv_params_validator, kv_stream_source, resolve_connector
from kvferry.engine.core import EngineStats
from kvferry.engine.core_client import CoreClient, CoreStart
from kvferry.engine.core_proc import CoreFactory, make_engine_core
from kvferry.engine.core_protocol import EngineDeadError, Outputs
from kvferry.engine.input_processor import InputProcessor
from kvferry.engine.output_processor import OutputProcessor
from kvferry.errors import InvalidRequestError, KVFerryError, UnknownRequestError
from kvferry.kv.usage import KVGroupStats, KVMemoryStats
from kvferry.messages.engine_core import EngineCoreOutput
from kvferry.messages.kv_connector import KVTransferParams
from kvferry.outputs import RequestOutput
from kvferry.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 2.0
MAX_KEPT_KV_IDS = 8192  # finished requests with kv_transfer_params remembered for release_kv


class RequestFailedError(KVFerryError, RuntimeError):
    """The engine failed this one request (others are unaffected): HTTP 500."""

    status_code = 500


@dataclass
class RequestTiming:
    arrival: float  # time.monotonic() when generate() accepted it
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class FinishedRequestStats:
    finish_reason: str  # stop | length | abort | error
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    e2e_latency: float
    time_to_first_token: float | None


@dataclass
class IterationStats:
    """What one batch of core outputs (or one abort) changed, for the metrics."""

    num_prompt_tokens: int = 0  # of requests whose first token arrived in this batch
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    def record(self, stats: IterationStats) -> None: ...


@dataclass
class _Stream:
    timing: RequestTiming
    # RequestOutput, an exception to raise, or None (aborted: end quietly)
    queue: asyncio.Queue[RequestOutput | BaseException | None] = field(default_factory=asyncio.Queue)
    finished: bool = False


def _request_error(message: str | None, invalid_param: str | None) -> KVFerryError:
    """The exception a failed request raises: the client's fault (400) or the engine's (500)."""
    message = message or "the engine failed this request"
    if invalid_param is not None:
        return InvalidRequestError(message, param=invalid_param or None)
    return RequestFailedError(message)


def _stats_from_wire(raw: dict[str, Any]) -> EngineStats:
    names = {f.name for f in dataclasses.fields(EngineStats)}
    fields = {k: v for k, v in raw.items() if k in names}
    if isinstance(fields.get("kv_memory"), dict):
        fields["kv_memory"] = KVMemoryStats(**fields["kv_memory"])
    fields["kv_groups"] = [KVGroupStats(**g) for g in fields.get("kv_groups", ())]
    return EngineStats(**fields)


class AsyncEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        client: CoreClient,
        input_processor: InputProcessor,
        output_processor: OutputProcessor,
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        self.model_config = model_config
        self.client = client
        self.input_processor = input_processor
        self.output_processor = output_processor
        self.tokenizer = tokenizer
        self._stats = _stats_from_wire(client.wait_ready())
        self._streams: dict[str, _Stream] = {}
        self._stat_loggers: list[StatLogger] = []
        self._stats_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._dead: BaseException | None = None
        # Finished requests whose answer carried kv_transfer_params (the connector may keep
        # their KV for a remote consumer), oldest first: the ids release_kv accepts.
        self._kept_kv: OrderedDict[str, None] = OrderedDict()
        # P/D, layer-wise: what decoders stream this instance's prefills with (None: they cannot).
        self.kv_stream_source: KVTransferParams | None = None

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        core_factory: CoreFactory = make_engine_core,
        startup_timeout_s: float = 900.0,
        start: CoreStart = CoreStart.SPAWN,
    ) -> AsyncEngine:
        """Load the tokenizer, start the core process (CoreStart) and wait until it is ready."""
        from kvferry.model.tokenizer import load_tokenizer

        config = resolve_connector(config)  # once: the core process gets it resolved
        client = CoreClient(config, core_factory, wait=False, start=start)
        try:
            tokenizer = load_tokenizer(config.model)  # while the core loads the model
            client.wait_ready(startup_timeout_s)
        except BaseException:
            client.shutdown()
            raise
        inputs = InputProcessor(config.model, tokenizer, kv_params_validator(config))
        engine = cls(config.model, client, inputs, OutputProcessor(tokenizer), tokenizer)
        engine.kv_stream_source = kv_stream_source(config)
        return engine

    # -- public API ----------------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """The core's stats as of its last message."""
        return self._stats

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    @property
    def is_dead(self) -> bool:
        return self._dead is not None or not self.client.is_alive()

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self._stat_loggers.append(stat_logger)

    def check_health(self) -> None:
        if self.is_dead:
            raise EngineDeadError(str(self._dead) if self._dead else "engine core process is not running")

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has ``finished=True``.

        Raises InvalidRequestError before anything is queued, RequestFailedError when the
        engine fails this request and EngineDeadError when the core process is gone.
        """
        self._ensure_running()
        self._check_new_id(request_id)
        # Tokenizing a long prompt takes seconds: off the event loop, so /health and every
        # other stream keep being served meanwhile.
        req = await asyncio.to_thread(
            self.input_processor.process, request_id, prompt, params, kv_transfer_params
        )
        self._check_new_id(request_id)  # taken while tokenizing
        stream = _Stream(RequestTiming(time.monotonic(), len(req.prompt_token_ids)))
        self._streams[request_id] = stream
        text = prompt if isinstance(prompt, str) else None
        self.output_processor.add_request(request_id, text, req.prompt_token_ids, req.sampling_params)
        try:
            self.client.add_request(req)
            while True:
                item = await stream.queue.get()
                if item is None:  # aborted by abort()
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                self._abort_stream(request_id, stream)
            self._streams.pop(request_id, None)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")

    async def abort(self, request_id: str) -> None:
        """Abort a request: its ``generate`` ends (without a final output) and its blocks are freed."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return
        self._abort_stream(request_id, stream)
        stream.queue.put_nowait(None)

    def release_kv(self, request_id: str) -> None:
        """The KV the connector keeps for a finished request's remote consumer will not be
        read (the client left between prefill and decode): free it now, not at lease expiry.

        Idempotent. Raises UnknownRequestError (HTTP 404) for an id that did not finish here
        with kv_transfer_params (of the last MAX_KEPT_KV_IDS such requests).
        """
        self.check_health()
        if request_id not in self._kept_kv:
            raise UnknownRequestError(f"no finished request {request_id!r} has KV kept here", "request_id")
        self.client.release_kv([request_id])

    async def refresh_stats(self, timeout_s: float = STATS_TIMEOUT_S) -> EngineStats:
        """Ask the core for its stats now (e.g. on a /metrics scrape)."""
        self._ensure_running()
        seq = self.client.request_stats()
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append((seq, fut))
        try:
            await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            logger.warning("engine stats not refreshed within %.1f s", timeout_s)
        return self._stats

    def stop(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests and end every open one with EngineDeadError(reason) (HTTP 503).

        Does not wait; the core process keeps running until ``shutdown``.
        """
        if self._dead is None:
            self._dead = EngineDeadError(reason)
            logger.info("engine stopped: %s", reason)
        failed = self._fail_all(self._dead)
        try:
            self.client.abort_requests(failed)
        except EngineDeadError:
            pass

    def shutdown(self) -> None:
        """Stop the output task (when called on its loop) and the core process."""
        if self._task is not None and not self._task.done():
            try:
                if self._task.get_loop() is asyncio.get_running_loop():
                    self._task.cancel()
            except RuntimeError:  # no running loop: the task's loop is gone with it
                pass
        self.stop("the engine is shutting down")
        self.client.shutdown()

    # -- internals ----------------------------------------------------------------------

    def _ensure_running(self) -> None:
        self.check_health()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._output_loop(), name="kvferry-outputs")

    def _abort_stream(self, request_id: str, stream: _Stream) -> None:
        stream.finished = True
        self.output_processor.abort_request(request_id)
        self._record(IterationStats(finished=[self._finished_stats(stream.timing, "abort")]))
        try:
            self.client.abort_requests([request_id])
        except EngineDeadError:
            pass
        logger.debug("aborted %s", request_id)

    async def _output_loop(self) -> None:
        try:
            while True:
                self._handle(await self.client.get_outputs())
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if self._dead is not None:  # stopped: the core going away is expected
                logger.info("engine output loop ends: %s", exc)
                return
            logger.exception("engine output loop failed; failing all requests")
            self._dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"engine failed: {exc}")
            self._fail_all(self._dead)

    def _handle(self, msg: Outputs) -> None:
        self._stats = _stats_from_wire(msg.stats)
        self._wake_stats_waiters(msg.stats_seq)
        if not msg.outputs:
            return
        iteration = self._time_outputs(msg.outputs)
        try:
            processed = self.output_processor.process_outputs(msg.outputs)
        except Exception as exc:  # a detokenizer bug must not take every request down
            logger.exception("output processing failed for %d outputs", len(msg.outputs))
            self._fail_batch(msg.outputs, RequestFailedError(f"output processing failed: {exc}"))
            return
        for out in processed.request_outputs:
            self._route(out, iteration)
        if processed.reqs_to_abort:
            self.client.abort_requests(processed.reqs_to_abort)
        self._fail_unrouted_errors(msg.outputs)
        self._record(iteration)

    def _time_outputs(self, outputs: list[EngineCoreOutput]) -> IterationStats:
        now = time.monotonic()
        it = IterationStats()
        for out in outputs:
            stream = self._streams.get(out.req_id)
            if stream is None or not out.new_token_ids:
                continue
            timing = stream.timing
            if timing.first_token is None:
                timing.first_token = now
                timing.num_cached_tokens = out.num_cached_tokens
                it.time_to_first_tokens.append(now - timing.arrival)
                it.num_prompt_tokens += timing.num_prompt_tokens
            else:
                it.inter_token_latencies.append(now - (timing.last_token or now))
            timing.last_token = now
            timing.num_generation_tokens += len(out.new_token_ids)
            it.num_generation_tokens += len(out.new_token_ids)
        return it

    def _route(self, out: RequestOutput, iteration: IterationStats) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None or stream.finished:
            return
        if not out.finished:
            stream.queue.put_nowait(out)
            return
        stream.finished = True
        reason = out.outputs[0].finish_reason if out.outputs else None
        if out.error is not None or reason == "error":
            iteration.finished.append(self._finished_stats(stream.timing, "error"))
            stream.queue.put_nowait(_request_error(out.error, out.invalid_param))
            return
        iteration.finished.append(self._finished_stats(stream.timing, reason or "stop"))
        if out.kv_transfer_params is not None:
            self._remember_kept_kv(out.request_id)
        stream.queue.put_nowait(out)

    def _remember_kept_kv(self, request_id: str) -> None:
        self._kept_kv[request_id] = None
        while len(self._kept_kv) > MAX_KEPT_KV_IDS:
            self._kept_kv.popitem(last=False)

    def _fail(self, request_id: str, error: BaseException) -> bool:
        """End an open request's stream with ``error``; False if it is gone or already ended."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return False
        stream.finished = True
        self.output_processor.abort_request(request_id)
        stream.queue.put_nowait(error)
        return True

    def _fail_unrouted_errors(self, outputs: list[EngineCoreOutput]) -> None:
        """An error output the output processor did not turn into a RequestOutput."""
        for out in outputs:
            if out.error is not None:
                self._fail(out.req_id, _request_error(out.error, out.invalid_param))

    def _fail_batch(self, outputs: list[EngineCoreOutput], error: BaseException) -> None:
        self.client.abort_requests([out.req_id for out in outputs if self._fail(out.req_id, error)])

    def _fail_all(self, error: BaseException) -> list[str]:
        """End every open request (and stats wait) with ``error``; the ids it failed."""
        failed = [rid for rid in list(self._streams) if self._fail(rid, error)]
        for _, fut in self._stats_waiters:
            if not fut.done():
                fut.set_result(None)
        self._stats_waiters.clear()
        return failed

    def _wake_stats_waiters(self, answered: int) -> None:
        keep: list[tuple[int, asyncio.Future[None]]] = []
        for seq, fut in self._stats_waiters:
            if seq <= answered:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((seq, fut))
        self._stats_waiters = keep

    @staticmethod
    def _finished_stats(timing: RequestTiming, reason: str) -> FinishedRequestStats:
        now = time.monotonic()
        ttft = timing.first_token - timing.arrival if timing.first_token is not None else None
        return FinishedRequestStats(
            reason,
            timing.num_prompt_tokens,
            timing.num_generation_tokens,
            timing.num_cached_tokens,
            now - timing.arrival,
            ttft,
        )

    def _record(self, stats: IterationStats) -> None:
        for stat_logger in self._stat_loggers:
            try:
                stat_logger.record(stats)
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)
