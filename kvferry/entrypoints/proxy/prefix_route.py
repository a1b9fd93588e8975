"""`--policy prefix`: send a request where its prompt's KV already is, weighed against load.

The proxy computes the prompt's token ids as the instances do (the same tokenizer, chat
template and BOS rule: kvferry.engine.input_processor) and their block hashes with the
engine's own function (kvferry.scheduler.hashing), then asks the PrefixIndex how many
leading blocks each instance holds. The choice is a cost, in prompt tokens:

    cost = uncached prompt tokens + in-flight requests x load_tokens

and the cheapest candidate wins (ties: fewer in flight, then round-robin order). With
`load_tokens` = 512 (the default, `--prefix-load-tokens`) an instance holding a 2,000-token
prefix still gets the request while it has up to 3 more requests in flight than an idle
one without it. A request whose prompt cannot be hashed, and instances whose events are
missing or late, just score no hit: the choice falls back to load.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from kvferry.engine.input_processor import InputProcessor
from kvferry.entrypoints.openai.protocol import ChatCompletionRequest
from kvferry.entrypoints.proxy.config import DEFAULT_LOAD_TOKENS
from kvferry.entrypoints.proxy.kv_event_feed import EventSource
from kvferry.entrypoints.proxy.pool import Instance
from kvferry.entrypoints.proxy.prefix_index import PrefixIndex, RouteKey
from kvferry.errors import KVFerryError
from kvferry.scheduler.hashing import BlockHash, hash_block_tokens

logger = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"  # kvferry.entrypoints.proxy.pd.CHAT (which imports this module)


class PromptHasher:
    """A request body -> its RouteKey, as the instances would tokenize and hash it."""

    def __init__(self, inputs: InputProcessor, block_size: int):
        self.inputs = inputs
        self.block_size = block_size

    def route_key(self, path: str, body: dict[str, Any]) -> RouteKey | None:
        """None when the prompt is not one the proxy can tokenize (the instance decides)."""
        try:
            tokens = self.inputs.tokenize(self._prompt(path, body))
        except (KVFerryError, ValueError, TypeError) as exc:
            logger.debug("no prefix route for this request: %s", exc)
            return None
        return RouteKey(len(tokens), tuple(self.hashes(tokens)))

    def _prompt(self, path: str, body: dict[str, Any]) -> str | list[int]:
        if path == CHAT:
            chat = ChatCompletionRequest.model_validate(body)
            if chat.prompt_token_ids is not None:
                return list(chat.prompt_token_ids)
            return self.inputs.apply_chat_template(chat.template_messages(), chat.add_generation_prompt)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # one prompt of a batch (each leg is one)
        if not isinstance(prompt, str | list):
            raise TypeError("the prompt is neither text nor token ids")
        return prompt

    def hashes(self, tokens: Sequence[int]) -> list[BlockHash]:
        """The hashes of the full blocks the engine would cache for these tokens."""
        out: list[BlockHash] = []
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            out.append(hash_block_tokens(out[-1] if out else None, tokens[start : start + size]))
        return out


class PrefixAware:
    """The cheapest candidate by cached prefix and load (module docstring)."""

    def __init__(self, index: PrefixIndex, load_tokens: int = DEFAULT_LOAD_TOKENS):
        self.index = index
        self.load_tokens = load_tokens
        self._next = 0
        self.num_hits = 0  # picks where the chosen instance held part of the prompt

    def cost(self, inst: Instance, route: RouteKey | None) -> int:
        cached = 0 if route is None else self.index.cached_blocks(inst.url, route.block_hashes)
        uncached = 0 if route is None else route.num_tokens - cached * self.index.block_size
        return uncached + inst.in_flight * self.load_tokens

    def pick(
        self, instances: Sequence[Instance], candidates: Collection[Instance], route: RouteKey | None = None
    ) -> Instance:
        n = len(instances)
        order = {id(inst): (i - self._next) % n for i, inst in enumerate(instances)}
        best = min(candidates, key=lambda inst: (self.cost(inst, route), inst.in_flight, order[id(inst)]))
        self._next = instances.index(best) + 1
        if route is not None and self.index.cached_blocks(best.url, route.block_hashes):
            self.num_hits += 1
        return best


@dataclass
class PrefixRouting:
    """--policy prefix's parts: one index and policy for both roles, the prompt hasher, and
    the instances' event sources."""

    index: PrefixIndex
    hasher: PromptHasher
    sources: list[EventSource]

    def policy(self, load_tokens: int) -> PrefixAware:
        return PrefixAware(self.index, load_tokens)


def prefix_routing(tokenizer_model: str, block_size: int, sources: list[EventSource]) -> PrefixRouting:
    """Load the instances' tokenizer (their model's, offline) and set up the index."""
    from kvferry.model.resolve import resolve_model_config
    from kvferry.model.tokenizer import load_tokenizer

    model = resolve_model_config(tokenizer_model)
    inputs = InputProcessor(model, load_tokenizer(model))
    return PrefixRouting(PrefixIndex(block_size), PromptHasher(inputs, block_size), sources)
