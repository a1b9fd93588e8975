"""Offline API: LLM(model).generate(prompts, SamplingParams(...)) and LLM.chat(messages)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from kvferry.config import EngineConfig, EngineOptions
from kvferry.engine.core import EngineCore, EngineStats
from kvferry.engine.input_processor import ChatMessage, InputProcessor
from kvferry.engine.options import engine_config
from kvferry.engine.output_processor import OutputProcessor
from kvferry.engine.parallel_sampling import child_params, merge_children, num_children
from kvferry.errors import InvalidRequestError
from kvferry.messages.engine_core import EngineCoreRequest
from kvferry.model.tokenizer import load_tokenizer
from kvferry.outputs import RequestOutput
from kvferry.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from typing_extensions import TypeIs

logger = logging.getLogger(__name__)


class PromptDict(TypedDict, total=False):
    """A prompt as vLLM takes it: one of the two keys (checked by prompt_input)."""

    prompt: str
    prompt_token_ids: list[int]


# Text, token ids, or (as vLLM takes them) {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | list[int] | PromptDict


def _is_one_prompt(prompts: Prompt | Sequence[Prompt]) -> TypeIs[Prompt]:
    """One prompt (text, token ids or a prompt dict), not a sequence of them."""
    return isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
    )


def prompt_input(prompt: Prompt) -> str | list[int]:
    """The text or token ids a prompt stands for."""
    if not isinstance(prompt, dict):
        return prompt
    if len(prompt) == 1 and "prompt" in prompt:
        return prompt["prompt"]
    if len(prompt) == 1 and isinstance(prompt.get("prompt_token_ids"), list):
        return prompt["prompt_token_ids"]  # its items are checked with any token-id prompt
    raise InvalidRequestError(
        f"a prompt dict holds one key, 'prompt' (text) or 'prompt_token_ids' (a list), not {prompt!r:.80}",
        param="prompt",
    )


class LLM:
    def __init__(self, model: str, **options: Any):
        """An engine for `model` (a local dir, a cached hub id, a .gguf file or 'smollm2').

        `options` are kvferry.config.EngineOptions' fields, with its defaults: dtype,
        max_model_len, tensor_parallel_size, block_size, kv_cache_bytes,
        kv_cache_memory_fraction, enable_prefix_caching, max_num_seqs,
        max_num_batched_tokens, seed, enforce_eager, kv_allocator, quantization,
        prefill_budget_with_decodes, and the rest of `kvferry serve`'s engine options.
        """
        self.__init_from_config(engine_config(EngineOptions(model, **options)))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.__init_from_config(config)
        return llm

    def __init_from_config(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.engine = EngineCore(config)
        self.inputs = InputProcessor(config.model, self.tokenizer)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        batch: Sequence[Prompt] = [prompts] if _is_one_prompt(prompts) else prompts
        prompts = [prompt_input(prompt) for prompt in batch]
        params = params or SamplingParams()
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        # Validate every prompt before queueing any, so a bad one leaves nothing behind.
        families = [self._children(pr, p) for pr, p in zip(prompts, param_list)]
        waiting: dict[str, list[EngineCoreRequest]] = {}  # first child -> its siblings (n > 1)
        for prompt, children in zip(prompts, families):
            text = prompt if isinstance(prompt, str) else None
            for request in children:
                self.outputs.add_request(
                    request.req_id, text, request.prompt_token_ids, request.sampling_params
                )
            self.engine.add_request(children[0])
            waiting[children[0].req_id] = children[1:]
        order = [r.req_id for children in families for r in children]
        finished = dict(zip(order, self._run(order, waiting), strict=True))
        return [
            merge_children([finished[r.req_id] for r in children], params)
            for children, params in zip(families, param_list)
        ]

    def _children(self, prompt: str | list[int], params: SamplingParams) -> list[EngineCoreRequest]:
        """One engine request per answer (parallel_sampling.py); ids unique to this LLM."""
        base = str(next(self._ids))
        count = num_children(params)
        ids = [base] if count == 1 else [f"{base}-{c}" for c in range(count)]
        return [self.inputs.process(rid, prompt, child_params(params, c)) for c, rid in enumerate(ids)]

    def chat(
        self, messages: list[ChatMessage] | list[list[ChatMessage]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        conversations = [messages] if _is_one_conversation(messages) else messages
        prompts = [self.inputs.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, params)

    def _run(
        self, order: list[str], waiting: dict[str, list[EngineCoreRequest]] | None = None
    ) -> list[RequestOutput]:
        """Step until every request finished; the final outputs in ``order``. A first
        child's siblings (``waiting``) are added once it has an output (its prompt's KV is
        then in the prefix cache)."""
        waiting = waiting or {}
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            processed = self.outputs.process_outputs(self.engine.step())
            if processed.reqs_to_abort:
                self.engine.abort_requests(processed.reqs_to_abort)
            for out in processed.request_outputs:
                for sibling in waiting.pop(out.request_id, []):
                    self.engine.add_request(sibling)
                if out.finished:
                    finished[out.request_id] = out
        return [finished[request_id] for request_id in order]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer


def _is_one_conversation(
    messages: list[ChatMessage] | list[list[ChatMessage]],
) -> TypeIs[list[ChatMessage]]:
    """A list of messages, not a list of conversations."""
    return bool(messages) and isinstance(messages[0], dict)
