"""The one place an EngineConfig is built from user options (EngineOptions): `LLM(...)` and
the command line both come here, so a default or a check is stated once."""

from __future__ import annotations

from kvferry.config import EngineConfig, EngineOptions, MLAForms
from kvferry.model.resolve import resolve_model_config


def engine_config(options: EngineOptions) -> EngineConfig:
    """Resolve the model named by `options` and build the EngineConfig around it."""
    model = resolve_model_config(
        options.model,
        dtype=options.dtype,
        max_model_len=options.max_model_len,
        served_model_name=options.served_model_name,
        quantization=options.quantization,
        mla_forms=MLAForms(options.mla_prefill, options.mla_decode),
    )
    return options.engine_config(model)
