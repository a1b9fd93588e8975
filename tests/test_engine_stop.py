"""Stopping the engine: AsyncEngine.stop, and SIGTERM to the core process (fake core)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvferry.config import CacheConfig, EngineConfig
from kvferry.engine.async_engine import AsyncEngine
from kvferry.engine.core_client import CoreClient
from kvferry.engine.core_fake import FakeCoreFactory, FakeEngineCore, fake_model_config
from kvferry.engine.core_protocol import EngineDeadError
from kvferry.messages.engine_core import EngineCoreRequest
from kvferry.sampling_params import SamplingParams

CONFIG = EngineConfig(model=fake_model_config(), cache=CacheConfig(block_size=4))
QUICK_EXIT_S = 3.0  # the core stops within ~0.3 s; the machine is shared


@dataclass(frozen=True)
class SlowStartFactory:
    """A fake core that takes ``load_s`` to build, like a large model; it creates ``marker`` first."""

    load_s: float
    marker: str

    def __call__(self, config: EngineConfig) -> FakeEngineCore:
        Path(self.marker).touch()
        time.sleep(self.load_s)
        return FakeEngineCore(config)


def _long_request(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [10, 11], SamplingParams(max_tokens=10_000, ignore_eos=True), time.time())


def _wait_exit(client: CoreClient, start: float) -> float:
    while client._proc.is_alive():
        assert time.monotonic() - start < QUICK_EXIT_S, "the core process did not stop"
        time.sleep(0.01)
    return time.monotonic() - start


def test_sigterm_stops_a_serving_core_between_steps() -> None:
    client = CoreClient(CONFIG, FakeCoreFactory(step_delay_s=0.002))
    try:
        client.add_request(_long_request("long"))

        async def outputs_until_death() -> None:
            while True:
                await client.get_outputs()

        start = time.monotonic()
        os.kill(client.pid, signal.SIGTERM)
        with pytest.raises(EngineDeadError, match="exit code 0"):
            asyncio.run(asyncio.wait_for(outputs_until_death(), QUICK_EXIT_S))
        _wait_exit(client, start)
    finally:
        client.shutdown()


@pytest.mark.slow  # several seconds (make test-all)
def test_shutdown_of_a_loading_core_does_not_wait_for_the_load(tmp_path: Path) -> None:
    marker = tmp_path / "loading"
    client = CoreClient(CONFIG, SlowStartFactory(load_s=60, marker=str(marker)), wait=False)
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert time.monotonic() < deadline, "the core never started loading"
        time.sleep(0.01)
    start = time.monotonic()
    client.shutdown()
    assert time.monotonic() - start < QUICK_EXIT_S
    assert client._proc.exitcode == 0


def test_stop_ends_open_requests_and_refuses_new_ones(tiny_llama: Path) -> None:
    config = EngineConfig(model=fake_model_config(local_dir=str(tiny_llama)), cache=CacheConfig(block_size=4))
    engine = AsyncEngine.from_config(config, FakeCoreFactory(step_delay_s=0.002))
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def go() -> None:
        stream = engine.generate([5, 6, 7], params, "open")
        await anext(stream)
        engine.stop("going down")
        with pytest.raises(EngineDeadError, match="going down"):
            await anext(stream)
        with pytest.raises(EngineDeadError, match="going down"):
            await anext(engine.generate([5], params, "late"))
        assert engine.is_dead and engine.num_active_requests == 0

    try:
        asyncio.run(go())
        with pytest.raises(EngineDeadError, match="going down"):
            engine.check_health()
    finally:
        engine.shutdown()
    assert not engine.client.is_alive()
