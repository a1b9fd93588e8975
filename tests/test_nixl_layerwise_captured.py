"""Layer-wise NIXL from inside the compiled program (invariant 2 with a connector that moves bytes).

A prompt whose blocks but its last token are in the prefiller's prefix cache completes in
a one-token step, which runs the compiled program (``--capture always``). The prefiller's
NixlConnector is graph-safe and, layer-wise, declares per-layer hooks, so its
``save_kv_layer`` runs inside that program as a registered operator and marks each layer
final there; a fault delay per layer keeps the forward slow enough that the decoder's
READs of the first layers start before the program ends. The step is counted as compiled,
layers are read early, and the decoder's answer equals a colocated engine's. With the
hooks outside the program (or absent), no layer would be final before the step's end.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path

import pytest

from kvferry.config import CaptureMode, CompilationConfig, KVTransferConfig
from kvferry.engine.core import EngineCore
from kvferry.messages.engine_core import EngineCoreRequest
from kvferry.ports import free_port
from kvferry.sampling_params import SamplingParams
from tests.test_nixl_layerwise import Stepping, _colocated, _config, _drain, _pairs, _run_together

# slow: compiles the tiny model's decode program (make test-all only)
pytestmark = pytest.mark.slow

BLOCK = 16


def test_a_prompt_completed_by_the_compiled_program_streams_its_layers_from_inside_it(
    tiny_qwen2: Path,
) -> None:
    port, engine_id = free_port(), f"lwc-{uuid.uuid4().hex[:8]}"
    extra = {"engine_id": engine_id, "side_channel_port": port, "lease_s": 20, "layerwise": True}
    producer = KVTransferConfig(
        "NixlConnector", kv_role="producer", kv_connector_extra_config={**extra, "fault_layer_delay_s": 0.2}
    )
    consumer = KVTransferConfig("NixlConnector", kv_role="consumer", kv_load_failure_policy="fail")
    compiled = CompilationConfig(capture=CaptureMode.ALWAYS)
    prefill_config = dataclasses.replace(_config(tiny_qwen2, producer, "NHD"), compilation=compiled)
    cores = [
        EngineCore(prefill_config),
        EngineCore(_config(tiny_qwen2, consumer, "NHD")),
        EngineCore(_config(tiny_qwen2, None, "NHD")),
    ]
    prefiller, decoder, colocated = cores
    try:
        prompt = [(7 * i) % 500 + 3 for i in range(BLOCK + 1)]  # one full block, then the last token
        warm = EngineCoreRequest("warm", prompt, SamplingParams(max_tokens=1), time.time())
        with Stepping(prefiller):
            prefiller.add_request(warm)  # its blocks enter the prefix cache
            deadline = time.monotonic() + 300
            while prefiller.has_unfinished_requests():
                assert time.monotonic() < deadline
                time.sleep(0.01)
        (stats,) = prefiller.executor.capture_stats()
        compiled_before = stats.compiled_steps
        before = decoder.stats().kv_connector
        pairs = _pairs([prompt], "cap", [uuid.uuid4().hex], engine_id, port)
        decoded, finals = _run_together(decoder, prefiller, pairs)
        (stats,) = prefiller.executor.capture_stats()
        assert stats.compiled_steps > compiled_before  # the prompt's last token ran compiled
        assert finals["cap-d0"].error is None, finals["cap-d0"].error
        assert (
            decoded["cap-d0"]
            == _colocated(colocated, [prompt], SamplingParams(max_tokens=8, temperature=0), "cap")[0]
        )
        after = decoder.stats().kv_connector
        assert after.get("nixl_layers_read_early", 0) > before.get("nixl_layers_read_early", 0), after
        _drain(prefiller, decoder)
    finally:
        for core in cores:
            core.shutdown()
