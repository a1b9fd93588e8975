"""AsyncEngine over the fake core (real tokenizer, input and output processors; no model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvferry.config import CacheConfig, EngineConfig
from kvferry.engine.async_engine import AsyncEngine, IterationStats, RequestFailedError
from kvferry.engine.core_fake import (
    CRASH_TOKEN,
    FAIL_ADD_TOKEN,
    FAIL_STEP_TOKEN,
    FakeCoreFactory,
    fake_model_config,
)
from kvferry.engine.core_protocol import EngineDeadError
from kvferry.errors import InvalidRequestError
from kvferry.sampling_params import SamplingParams

NUM_BLOCKS = 256


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=fake_model_config(local_dir=str(model_dir)), cache=CacheConfig(block_size=4))


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):
    eng = AsyncEngine.from_config(
        _config(tiny_llama), FakeCoreFactory(step_delay_s=0.002, num_blocks=NUM_BLOCKS)
    )
    yield eng
    eng.shutdown()


class Recorder:
    def __init__(self) -> None:
        self.stats: list[IterationStats] = []

    def record(self, stats: IterationStats) -> None:
        self.stats.append(stats)


def _expected_ids(first: int, n: int) -> list[int]:
    return [(first + 7 * (i + 1)) % 1000 for i in range(n)]


async def _run(engine: AsyncEngine, prompt, params: SamplingParams, rid: str, **kw):
    outs = [out async for out in engine.generate(prompt, params, rid, **kw)]
    return outs


async def _assert_idle(engine: AsyncEngine) -> None:
    stats = await engine.refresh_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == NUM_BLOCKS and stats.kv_cache_usage == 0.0
    assert engine.num_active_requests == 0


def test_generate_streams_deltas(engine: AsyncEngine) -> None:
    async def go():
        outs = await _run(engine, [100, 101, 102], SamplingParams(max_tokens=6), "g1")
        await _assert_idle(engine)
        return outs

    outs = asyncio.run(go())
    final = outs[-1]
    assert final.finished and all(not o.finished for o in outs[:-1])
    assert final.outputs[0].token_ids == _expected_ids(100, 6)
    assert final.outputs[0].finish_reason == "length"
    assert "".join(o.delta_text for o in outs) == final.outputs[0].text
    assert final.outputs[0].text == engine.tokenizer.decode(_expected_ids(100, 6))
    assert final.prompt_token_ids == [100, 101, 102]


def test_concurrent_requests(engine: AsyncEngine) -> None:
    async def go():
        tasks = [_run(engine, [200 + i], SamplingParams(max_tokens=5 + i), f"c{i}") for i in range(16)]
        results = await asyncio.gather(*tasks)
        await _assert_idle(engine)
        return results

    for i, outs in enumerate(asyncio.run(go())):
        assert outs[-1].outputs[0].token_ids == _expected_ids(200 + i, 5 + i)


def test_consumer_leaving_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    async def go():
        gen = engine.generate([300, 301], SamplingParams(max_tokens=200), "leave")
        await anext(gen)
        assert (await engine.refresh_stats()).num_running == 1
        await gen.aclose()
        await _assert_idle(engine)

    asyncio.run(go())


def test_cancelled_consumer_aborts(engine: AsyncEngine) -> None:
    async def go():
        first = asyncio.Event()

        async def consume():
            async for _ in engine.generate([310], SamplingParams(max_tokens=200), "cancel"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _assert_idle(engine)

    asyncio.run(go())


def test_abort_ends_generate_quietly(engine: AsyncEngine) -> None:
    async def go():
        outs = []
        async for out in engine.generate([320], SamplingParams(max_tokens=200), "ab"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("ab")
        await _assert_idle(engine)
        return outs

    outs = asyncio.run(go())
    assert 2 <= len(outs) < 200 and not outs[-1].finished


def test_stop_string_finishes_and_aborts_in_core(engine: AsyncEngine) -> None:
    full = engine.tokenizer.decode(_expected_ids(400, 12))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {full!r}"

    async def go():
        outs = await _run(engine, [400], SamplingParams(max_tokens=12, stop=[stop]), "stop")
        await _assert_idle(engine)
        return outs

    final = asyncio.run(go())[-1]
    assert final.finished and final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason == stop
    assert final.outputs[0].text == full[: full.index(stop)]


def test_invalid_requests_leave_nothing_behind(engine: AsyncEngine) -> None:
    async def go():
        with pytest.raises(InvalidRequestError):
            await _run(engine, [], SamplingParams(), "empty")
        with pytest.raises(InvalidRequestError, match="maximum context length"):
            await _run(engine, list(range(10, 300)), SamplingParams(max_tokens=1), "long")
        with pytest.raises(InvalidRequestError):
            await _run(engine, [5000], SamplingParams(max_tokens=1), "vocab")
        gen = engine.generate([500], SamplingParams(max_tokens=50), "dup")
        await anext(gen)
        with pytest.raises(InvalidRequestError, match="already in use"):
            await _run(engine, [501], SamplingParams(max_tokens=1), "dup")
        await gen.aclose()
        await _assert_idle(engine)

    asyncio.run(go())


def test_engine_errors_fail_only_affected_requests(engine: AsyncEngine) -> None:
    async def go():
        bad = asyncio.create_task(_run(engine, [FAIL_ADD_TOKEN, 600], SamplingParams(max_tokens=3), "bad"))
        good = asyncio.create_task(_run(engine, [601], SamplingParams(max_tokens=3), "good"))
        with pytest.raises(RequestFailedError, match="rejected"):
            await bad
        assert (await good)[-1].outputs[0].finish_reason == "length"
        with pytest.raises(RequestFailedError, match="step failure"):
            await _run(engine, [FAIL_STEP_TOKEN, 602], SamplingParams(max_tokens=3), "step")
        after = await _run(engine, [603], SamplingParams(max_tokens=2), "after")
        await _assert_idle(engine)
        return after

    assert asyncio.run(go())[-1].finished


def test_kv_transfer_params_round_trip(engine: AsyncEngine) -> None:
    outs = asyncio.run(_run(engine, [700], SamplingParams(max_tokens=2), "kv", kv_transfer_params={"a": 1}))
    assert outs[-1].kv_transfer_params == {"echo": {"a": 1}, "num_tokens": 3}


def test_stat_loggers_get_timings(engine: AsyncEngine) -> None:
    rec = Recorder()
    engine.add_stat_logger(rec)
    try:
        asyncio.run(_run(engine, [800, 801], SamplingParams(max_tokens=4), "timed"))
    finally:
        engine._stat_loggers.remove(rec)
    ttfts = [t for s in rec.stats for t in s.time_to_first_tokens]
    itls = [t for s in rec.stats for t in s.inter_token_latencies]
    finished = [f for s in rec.stats for f in s.finished]
    assert len(ttfts) == 1 and len(itls) == 3 and all(t >= 0 for t in ttfts + itls)
    assert sum(s.num_prompt_tokens for s in rec.stats) == 2
    assert sum(s.num_generation_tokens for s in rec.stats) == 4
    assert [(f.finish_reason, f.num_prompt_tokens, f.num_generation_tokens) for f in finished] == [
        ("length", 2, 4)
    ]


def test_core_crash_fails_requests_and_health(tiny_llama: Path) -> None:
    eng = AsyncEngine.from_config(_config(tiny_llama), FakeCoreFactory(step_delay_s=0.002))
    try:

        async def go():
            slow = asyncio.create_task(_run(eng, [900], SamplingParams(max_tokens=200), "slow"))
            await asyncio.sleep(0.05)
            with pytest.raises(EngineDeadError):
                await _run(eng, [CRASH_TOKEN, 901], SamplingParams(max_tokens=2), "crash")
            with pytest.raises(EngineDeadError):
                await slow
            with pytest.raises(EngineDeadError):
                await _run(eng, [902], SamplingParams(max_tokens=2), "later")

        asyncio.run(asyncio.wait_for(go(), 20))
        assert eng.is_dead
        with pytest.raises(EngineDeadError):
            eng.check_health()
    finally:
        eng.shutdown()
