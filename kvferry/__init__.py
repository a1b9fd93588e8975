"""kvferry: an LLM serving engine built for disaggregated prefill/decode."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvferry.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> type[LLM]:
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from kvferry.engine.llm import LLM

        return LLM
    raise AttributeError(name)
