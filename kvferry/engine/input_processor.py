"""Front-end side of inputs: tokenize, apply chat templates, validate against the model."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvferry.config import ModelConfig
from kvferry.constraint_params import check_some_token_allowed, check_token_ids_in_vocab, tokenize_bad_words
from kvferry.errors import InvalidRequestError
from kvferry.messages.engine_core import EngineCoreRequest
from kvferry.messages.kv_connector import KVTransferParams
from kvferry.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A chat message as the client sent it (a JSON object: "role", "content" as text or parts,
# ...); the chat template reads it.
ChatMessage = dict[str, Any]


class InputProcessor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: PreTrainedTokenizerBase,
        kv_params_validator: Callable[[KVTransferParams | None], None] | None = None,
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        # The KV connector's synchronous check of kv_transfer_params (raises InvalidRequestError).
        self.kv_params_validator = kv_params_validator

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            # A chat template that already wrote the BOS token must not get a second one.
            bos = self.tokenizer.bos_token
            ids: list[int] = self.tokenizer.encode(
                prompt, add_special_tokens=not (bos and prompt.startswith(bos))
            )
            return ids
        if not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        return list(prompt)

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> EngineCoreRequest:
        token_ids = self.tokenize(prompt)
        if params.bad_words and not params.bad_words_token_ids:
            bad = tokenize_bad_words(self.tokenizer, params.bad_words)
            params = dataclasses.replace(params, bad_words_token_ids=bad)
        self._validate(token_ids, params)
        check_token_ids_in_vocab(params, self.model_config.vocab_size)
        check_some_token_allowed(params, self.model_config.eos_token_ids)
        if params.prompt_logprobs is not None and (kv_transfer_params or {}).get("do_remote_prefill"):
            raise InvalidRequestError(
                "prompt_logprobs needs the prompt computed here, not received over P/D",
                param="prompt_logprobs",
            )
        if self.kv_params_validator is not None and kv_transfer_params is not None:
            self.kv_params_validator(kv_transfer_params)
        return EngineCoreRequest(request_id, token_ids, params, time.time(), kv_transfer_params)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        max_len = self.model_config.max_model_len
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(token_ids) >= max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens; the prompt has "
                f"{len(token_ids)} tokens (at least one token must be left to generate).",
                param="prompt",
            )
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens; the prompt has "
                f"{len(token_ids)} tokens and max_tokens is {params.max_tokens}.",
                param="max_tokens",
            )
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")

    def apply_chat_template(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict[Any, Any]] | None = None,  # function definitions, for templates that show them
    ) -> str:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        for msg in messages:
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise InvalidRequestError("each message needs a string 'role'", param="messages")
        shown: list[dict[Any, Any] | Callable[..., Any]] | None = list(tools) if tools else None
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=shown, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja errors on odd message content
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
        if not isinstance(text, str):  # tokenize=False renders one conversation as text
            raise TypeError(f"the chat template rendered {type(text).__name__}, not text")
        return text
