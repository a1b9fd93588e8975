"""The engine core process and its client, with the fake core (no model)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvferry.config import CacheConfig, EngineConfig
from kvferry.engine.core_client import CoreClient
from kvferry.engine.core_fake import (
    CRASH_TOKEN,
    FAIL_ADD_TOKEN,
    FAIL_STEP_TOKEN,
    FakeCoreFactory,
    fake_model_config,
)
from kvferry.engine.core_protocol import EngineDeadError, EngineStartupError, Outputs
from kvferry.messages.engine_core import EngineCoreOutput, EngineCoreRequest, FinishReason
from kvferry.sampling_params import SamplingParams

CONFIG = EngineConfig(model=fake_model_config(), cache=CacheConfig(block_size=4))


def _req(rid: str, prompt: list[int], max_tokens: int = 4, **kw) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), time.time())


async def _collect(
    client: CoreClient, until: set[str], timeout: float = 10.0
) -> dict[str, list[EngineCoreOutput]]:
    """Read outputs until every request in ``until`` finished."""
    got: dict[str, list[EngineCoreOutput]] = {}
    pending = set(until)

    async def read() -> None:
        while pending:
            msg = await client.get_outputs()
            for out in msg.outputs:
                got.setdefault(out.req_id, []).append(out)
                if out.finished:
                    pending.discard(out.req_id)

    await asyncio.wait_for(read(), timeout)
    return got


async def _fresh_stats(client: CoreClient, timeout: float = 5.0) -> Outputs:
    seq = client.request_stats()

    async def read() -> Outputs:
        while True:
            msg = await client.get_outputs()
            if msg.stats_seq >= seq:
                return msg

    return await asyncio.wait_for(read(), timeout)


@pytest.fixture(scope="module")
def client():
    c = CoreClient(CONFIG, FakeCoreFactory(step_delay_s=0.002, num_blocks=64))
    yield c
    c.shutdown()


def test_ready_stats_and_generation(client: CoreClient) -> None:
    assert client.initial_stats["num_blocks"] == 64
    assert client.initial_stats["num_free_blocks"] == 64

    async def go():
        client.add_request(_req("a", [10, 11, 12], max_tokens=3))
        client.add_request(_req("b", [20], max_tokens=2, stop_token_ids=[34]))
        got = await _collect(client, {"a", "b"})
        stats = await _fresh_stats(client)
        return got, stats

    got, stats = asyncio.run(go())
    assert [t for o in got["a"] for t in o.new_token_ids] == [17, 24, 31]
    assert got["a"][-1].finish_reason == FinishReason.LENGTH
    assert got["a"][0].num_prompt_tokens == 3
    assert [t for o in got["b"] for t in o.new_token_ids] == [27, 34]
    assert got["b"][-1].finish_reason == FinishReason.STOP and got["b"][-1].stop_reason == 34
    assert stats.stats["num_running"] == 0 and stats.stats["num_free_blocks"] == 64


def test_abort_frees_blocks(client: CoreClient) -> None:
    async def go():
        client.add_request(_req("long", [11, 12, 13, 16, 17], max_tokens=10_000))
        while True:  # until it runs
            msg = await client.get_outputs()
            if any(o.req_id == "long" for o in msg.outputs):
                break
        assert msg.stats["num_running"] == 1 and msg.stats["num_free_blocks"] < 64
        client.abort_requests(["long"])
        return await _fresh_stats(client)

    stats = asyncio.run(go()).stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == 64 and stats["kv_cache_usage"] == 0.0


def test_add_failure_fails_only_that_request(client: CoreClient) -> None:
    async def go():
        client.add_request(_req("bad", [FAIL_ADD_TOKEN, 9]))
        client.add_request(_req("good", [30]))
        return await _collect(client, {"bad", "good"})

    got = asyncio.run(go())
    assert got["bad"][-1].finish_reason == FinishReason.ERROR and "rejected" in got["bad"][-1].error
    assert got["good"][-1].finish_reason == FinishReason.LENGTH and got["good"][-1].error is None


def test_step_failure_fails_in_flight_requests_and_keeps_serving(client: CoreClient) -> None:
    async def go():
        client.add_request(_req("x1", [40], max_tokens=50))
        client.add_request(_req("x2", [FAIL_STEP_TOKEN, 41], max_tokens=50))
        failed = await _collect(client, {"x1", "x2"})
        client.add_request(_req("after", [50], max_tokens=2))
        after = await _collect(client, {"after"})
        return failed, after, await _fresh_stats(client)

    failed, after, stats = asyncio.run(go())
    for rid in ("x1", "x2"):
        assert failed[rid][-1].finish_reason == FinishReason.ERROR
        assert "step failure injected" in failed[rid][-1].error
    assert after["after"][-1].finish_reason == FinishReason.LENGTH
    assert stats.stats["num_free_blocks"] == 64


def test_startup_failure_is_reported() -> None:
    with pytest.raises(EngineStartupError, match="ModelLoadError: fake: cannot load fake-model") as info:
        CoreClient(CONFIG, FakeCoreFactory(fail_startup=True))
    assert info.value.remote_type == "ModelLoadError"
    assert "Traceback" in info.value.remote_traceback


def test_crash_surfaces_as_engine_dead() -> None:
    c = CoreClient(CONFIG, FakeCoreFactory())
    try:

        async def go():
            c.add_request(_req("boom", [CRASH_TOKEN]))
            while True:
                await c.get_outputs()

        with pytest.raises(EngineDeadError, match="exit code 3"):
            asyncio.run(asyncio.wait_for(go(), 10))
        with pytest.raises(EngineDeadError):
            c.add_request(_req("late", [11]))
    finally:
        c.shutdown()


@pytest.mark.slow  # a parent process killed under its core
def test_core_exits_when_parent_is_killed(tmp_path) -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from kvferry.engine.core_client import CoreClient
        from kvferry.engine.core_fake import FakeCoreFactory
        from tests.test_async_engine_core_proc import CONFIG
        if __name__ == "__main__":
            c = CoreClient(CONFIG, FakeCoreFactory())
            print(c.pid, c._dir, flush=True)
            time.sleep(60)
        """
    )
    path = tmp_path / "parent.py"
    path.write_text(script)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    parent = subprocess.Popen(
        [sys.executable, str(path)], stdout=subprocess.PIPE, text=True, env=env, cwd=root
    )
    try:
        pid, ipc_dir = parent.stdout.readline().split()
        child_pid = int(pid)
        assert os.path.isdir(ipc_dir)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(5)
        deadline = time.monotonic() + 10
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child_pid), "the core process outlived its parent"
        assert not os.path.exists(ipc_dir), "the orphaned core left its socket files"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_two_clients_side_by_side(client: CoreClient) -> None:
    other = CoreClient(CONFIG, FakeCoreFactory())
    try:

        async def go():
            other.add_request(_req("o", [60], max_tokens=2))
            client.add_request(_req("c", [70], max_tokens=2))
            return await _collect(other, {"o"}), await _collect(client, {"c"})

        got_other, got_client = asyncio.run(go())
        assert list(got_other) == ["o"] and list(got_client) == ["c"]
    finally:
        other.shutdown()
    assert not other.is_alive()
