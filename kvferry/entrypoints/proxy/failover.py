"""Decode failover: a decoder that dies during a leg does not end the client's answer.

The answer is continued on another decode instance as a colocated-style request (no
``kv_transfer_params``: that decoder recomputes the prompt itself). A fresh prefill leg
is not used: it would add a second transfer and a second instance to fail, and what
matters for the answer is only that the new decoder sees the same tokens.

Non-streamed, nothing has reached the client: the original request is sent again.
Streamed, the client already has some text: the decode request asks for token ids
(``return_token_ids``, completions only), so the proxy knows the prompt's and the sent
tokens' ids, and the continuation's prompt is those ids, not re-tokenized text (text
does not always tokenize back into the same ids). ``max_tokens`` shrinks by the tokens
already sent, and usage is corrected to count them as completion tokens. A greedy answer
is then byte-identical to an undisturbed one; a seeded sampled one is not (the new
decoder's random stream starts over).

Chat streams are not continued (the chat endpoint takes no token-id prompt): their
client gets the in-stream error, as before.
"""

from __future__ import annotations

import copy

from kvferry.entrypoints.proxy.errors import UpstreamTimeoutError, UpstreamUnavailableError

# What a dead or hung decoder raises; another decoder may still answer.
DECODER_LOST = (UpstreamUnavailableError, UpstreamTimeoutError)
TOKEN_ID_FIELDS = ("token_ids", "prompt_token_ids")


class SentTokens:
    """The token ids of one leg's answer that a decoder already streamed."""

    def __init__(self) -> None:
        self.prompt: list[int] | None = None
        self.generated: list[int] = []
        self.resumed_after = 0  # tokens sent before the current decoder took over

    def record(self, chunk: dict, keep_ids: bool) -> None:
        """Note the chunk's ids; drop them from it unless the client asked for them."""
        for choice in chunk.get("choices") or []:
            prompt = choice.get("prompt_token_ids")
            if self.prompt is None and isinstance(prompt, list):
                self.prompt = list(prompt)  # a later decoder's (longer) prompt is not kept
            self.generated.extend(choice.get("token_ids") or [])
            if not keep_ids:
                for name in TOKEN_ID_FIELDS:
                    choice.pop(name, None)
            elif self.resumed_after:
                choice.pop("prompt_token_ids", None)  # the client got the real prompt's already

    def resume_body(self, body: dict) -> dict:
        """The request that continues the answer on another decoder."""
        out = copy.deepcopy(body)
        out.pop("kv_transfer_params", None)
        out["return_token_ids"] = True
        if self.prompt is None:  # the lost decoder sent nothing: start over
            return out
        out["prompt"] = self.prompt + self.generated
        if isinstance(out.get("max_tokens"), int):
            out["max_tokens"] = max(1, out["max_tokens"] - len(self.generated))
        self.resumed_after = len(self.generated)
        return out

    def fix_usage(self, chunk: dict) -> None:
        """Count tokens sent before a failover as completion tokens, not the prompt's."""
        usage = chunk.get("usage")
        if not self.resumed_after or not isinstance(usage, dict):
            return
        usage["prompt_tokens"] = usage.get("prompt_tokens", 0) - self.resumed_after
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.resumed_after
