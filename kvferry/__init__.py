"""kvferry: an LLM serving engine built for disaggregated prefill/decode."""

from kvferry.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from kvferry.engine.llm import LLM

        return LLM
    raise AttributeError(name)
