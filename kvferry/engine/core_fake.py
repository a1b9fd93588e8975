"""A deterministic stand-in for EngineCore: the front end's tests run without a model.

It keeps the real core's contract (add / abort / release_kv / step /
has_unfinished_requests / stats / shutdown), emits one token per running request per step (token ``i`` of a request is
``(first_prompt_token + 7 * (i + 1)) % vocab``), finishes on ``max_tokens``, EOS or a stop
token, and books KV blocks like a paged cache (``ceil(tokens / block_size)`` per request,
all freed at finish or abort). Magic prompt tokens inject faults:

    FAIL_ADD_TOKEN   add_request raises (that request gets an error output)
    FAIL_STEP_TOKEN  the step after the request was added raises (everything in flight fails)
    CRASH_TOKEN      the process dies at the next step (os._exit)
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from kvferry.config import EngineConfig, ModelConfig
from kvferry.errors import ModelLoadError
from kvferry.messages.engine_core import EngineCoreOutput, EngineCoreRequest, FinishReason
from kvferry.messages.model_runner import SampleLogprobs

logger = logging.getLogger(__name__)

FAIL_ADD_TOKEN = 997
FAIL_STEP_TOKEN = 998
CRASH_TOKEN = 999


def fake_model_config(
    vocab_size: int = 1000, max_model_len: int = 256, local_dir: str | None = None
) -> ModelConfig:
    """A ModelConfig for a model that does not exist (the fake core never loads weights)."""
    return ModelConfig(
        model=local_dir or "fake-model",
        served_model_name="fake-model",
        architecture="FakeForCausalLM",
        hf_config=None,
        dtype=torch.float32,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        num_layers=1,
        num_attention_heads=1,
        num_kv_heads=1,
        head_dim=8,
        hidden_size=8,
        eos_token_ids=(0,),
        local_dir=local_dir,
    )


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


@dataclass
class _FakeRequest:
    req: EngineCoreRequest
    output: list[int] = field(default_factory=list)
    blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.req.prompt_token_ids) + len(self.output)


@dataclass(frozen=True)
class FakeCoreFactory:
    """Picklable factory (the core process builds the core from it)."""

    step_delay_s: float = 0.0
    num_blocks: int = 64
    fail_startup: bool = False

    def __call__(self, config: EngineConfig) -> FakeEngineCore:
        if self.fail_startup:
            raise ModelLoadError(f"fake: cannot load {config.model.model}")
        return FakeEngineCore(config, self.step_delay_s, self.num_blocks)


class FakeEngineCore:
    def __init__(self, config: EngineConfig, step_delay_s: float = 0.0, num_blocks: int = 64):
        self.vocab = config.model.vocab_size
        self.eos = set(config.model.eos_token_ids)
        self.block_size = config.cache.block_size
        self.max_running = config.scheduler.max_num_seqs
        self.step_delay_s = step_delay_s
        self.num_blocks = num_blocks
        self.free_blocks = num_blocks
        self.running: dict[str, _FakeRequest] = {}
        self.waiting: list[_FakeRequest] = []
        self.prefix_queries = 0
        self.fail_next_step = False

    def add_request(self, req: EngineCoreRequest) -> None:
        if FAIL_ADD_TOKEN in req.prompt_token_ids:
            raise ValueError("fake: add_request failure injected")
        if FAIL_STEP_TOKEN in req.prompt_token_ids:
            self.fail_next_step = True
        self.waiting.append(_FakeRequest(req))
        self.prefix_queries += len(req.prompt_token_ids)

    def abort_requests(self, req_ids: list[str]) -> None:
        ids = set(req_ids)
        for rid in ids & self.running.keys():
            self._free(self.running.pop(rid))
        self.waiting = [r for r in self.waiting if r.req.req_id not in ids]

    def release_kv(self, req_ids: list[str]) -> None:
        """Nothing to release: finished requests' blocks are freed at once."""

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[EngineCoreOutput]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("fake: step failure injected")
        self._admit()
        outputs = []
        for rid in list(self.running):
            outputs.append(self._advance(self.running[rid]))
        return outputs

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            fr = self.waiting[0]
            if CRASH_TOKEN in fr.req.prompt_token_ids:
                logger.error("fake: crash injected")
                os._exit(3)
            need = -(-(fr.num_tokens + 1) // self.block_size)
            if need > self.free_blocks:
                return
            self.waiting.pop(0)
            fr.blocks, self.free_blocks = need, self.free_blocks - need
            self.running[fr.req.req_id] = fr

    def _advance(self, fr: _FakeRequest) -> EngineCoreOutput:
        params = fr.req.sampling_params
        token = (fr.req.prompt_token_ids[0] + 7 * (len(fr.output) + 1)) % self.vocab
        first = not fr.output
        fr.output.append(token)
        need = -(-fr.num_tokens // self.block_size)
        if need > fr.blocks:  # the fake never runs out mid-request: tests size the pool
            self.free_blocks -= need - fr.blocks
            fr.blocks = need
        reason, stop_reason = self._finish(fr, token, params.max_tokens or 16)
        out = EngineCoreOutput(fr.req.req_id, [token], finish_reason=reason, stop_reason=stop_reason)
        if first:
            out.num_prompt_tokens = len(fr.req.prompt_token_ids)
        if params.logprobs is not None:
            top = [((token + k) % self.vocab, -0.1 * (k + 1)) for k in range(params.logprobs)]
            out.new_logprobs = [SampleLogprobs(-0.1, top)]
        if reason is not None:
            if fr.req.kv_transfer_params is not None:
                out.kv_transfer_params = {"echo": fr.req.kv_transfer_params, "num_tokens": fr.num_tokens}
            self._free(self.running.pop(fr.req.req_id))
        return out

    def _finish(
        self, fr: _FakeRequest, token: int, max_tokens: int
    ) -> tuple[FinishReason | None, int | None]:
        params = fr.req.sampling_params
        if token in params.stop_token_ids or (token in self.eos and not params.ignore_eos):
            return FinishReason.STOP, token
        if len(fr.output) >= max_tokens:
            return FinishReason.LENGTH, None
        return None, None

    def _free(self, fr: _FakeRequest) -> None:
        self.free_blocks += fr.blocks
        fr.blocks = 0

    def stats(self) -> FakeStats:
        used = self.num_blocks - self.free_blocks
        return FakeStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=used / self.num_blocks,
            num_free_blocks=self.free_blocks,
            num_blocks=self.num_blocks,
            prefix_cache_queries=self.prefix_queries,
        )

    def shutdown(self) -> None:
        logger.info("fake core shut down")
