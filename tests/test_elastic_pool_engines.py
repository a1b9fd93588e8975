"""Real engines serving different tiny models on one shared KV memory pool: a burst on one,
then a burst on the other, both complete without preemption where eager engines splitting
the same memory preempt; a request larger than the pool is refused; an engine killed with
-9 while holding pages gives the pool back to the other."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvferry.config import CacheConfig
from kvferry.engine.llm import LLM
from kvferry.kv.shared_pool import KVPoolSpec
from kvferry.kv.spec import KVAllocator
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS
from tests.test_elastic_engine import build_llm

BURST = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture
def pool_name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    KVPoolSpec(name).path.unlink(missing_ok=True)


def on_pool(model_dir: Path, spec: KVPoolSpec | None, num_blocks: int, allocator=KVAllocator.ELASTIC) -> LLM:  # noqa: ANN001
    """An engine of `num_blocks` blocks at most, drawing its pages from `spec` if given."""
    llm = build_llm(model_dir, allocator, num_blocks=num_blocks, budget=256)
    if spec is None:
        return llm
    llm.engine.shutdown()
    cache = replace(llm.config.cache, kv_memory_pool=spec)
    return LLM.from_config(replace(llm.config, cache=CacheConfig(**_fields(cache))))


def _fields(cache: CacheConfig) -> dict:
    return {name: getattr(cache, name) for name in CacheConfig.__dataclass_fields__}


def burst(llm: LLM, tag: str) -> int:
    """Every prompt at once, to the end; returns the most pool bytes the engine held."""
    for index, prompt in enumerate(PROMPT_TEXTS):
        llm.engine.add_request(llm.inputs.process(f"{tag}-{index}", prompt, BURST))
    peak = 0
    for _ in range(2000):  # a starved engine would step forever: fail instead
        if not llm.engine.has_unfinished_requests():
            return peak
        llm.engine.step()
        peak = max(peak, held(llm))
    raise AssertionError("the burst did not finish")


def held(llm: LLM) -> int:
    budget = llm.engine.scheduler.kv_cache_manager.pool.budget
    return budget.pool.held_bytes()


def peak_bytes(model_dir: Path, name: str) -> int:
    """The pool bytes one burst of this model takes, on a private pool of its own."""
    llm = on_pool(model_dir, KVPoolSpec(f"{name}-alone", 64 << 20), num_blocks=512)
    try:
        return burst(llm, "alone")
    finally:
        llm.engine.scheduler.kv_cache_manager.close()
        KVPoolSpec(f"{name}-alone").path.unlink(missing_ok=True)


def test_bursts_take_turns_on_one_pool_where_eager_halves_preempt(tiny_llama, tiny_qwen2, pool_name):
    peaks = [peak_bytes(tiny_llama, pool_name), peak_bytes(tiny_qwen2, pool_name)]
    size = max(peaks) * 5 // 4  # room for one burst at a time, not for both
    assert size < sum(peaks)
    spec = KVPoolSpec(pool_name, size)
    engines = [on_pool(tiny_llama, spec, 512), on_pool(tiny_qwen2, replace(spec, size_bytes=None), 512)]
    for index, llm in enumerate(engines):
        burst(llm, f"b{index}")
        assert llm.stats().num_preemptions == 0
        assert held(llm) == 0  # idle: every page went back to the pool
    # Eager engines splitting the same memory: each has half, and a burst does not fit.
    for model_dir, block_bytes in (
        (tiny_llama, _block_bytes(engines[0])),
        (tiny_qwen2, _block_bytes(engines[1])),
    ):
        eager = on_pool(model_dir, None, size // 2 // block_bytes, KVAllocator.EAGER)
        for index, prompt in enumerate(PROMPT_TEXTS):
            eager.engine.add_request(eager.inputs.process(f"e{index}", prompt, BURST))
        while eager.engine.has_unfinished_requests():
            eager.engine.step()
        assert eager.stats().num_preemptions > 0


def _block_bytes(llm: LLM) -> int:
    config = llm.engine.scheduler.kv_cache_manager.config
    return config.pool_page_bytes // config.blocks_per_page


def test_a_request_larger_than_the_pool_is_refused(tiny_llama, pool_name):
    llm = on_pool(tiny_llama, KVPoolSpec(pool_name, 288 << 10), 512)  # 24 blocks: 384 tokens
    assert llm.stats().num_blocks == 24
    (out,) = llm.generate({"prompt_token_ids": [5] * 450}, SamplingParams(max_tokens=4))
    assert out.error is not None and "more KV cache than the engine has" in out.error
    assert out.invalid_param == "prompt"  # the client's error: HTTP 400


# An engine on the pool that takes most of it, says so, and waits to be killed.
_HOLDER = """
import sys, time
from pathlib import Path
from kvferry.kv.shared_pool import KVPoolSpec
from kvferry.sampling_params import SamplingParams
from tests.test_elastic_pool_engines import PROMPT_TEXTS, held, on_pool
size = int(sys.argv[3])
llm = on_pool(Path(sys.argv[1]), KVPoolSpec(sys.argv[2], size), 512)
params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
for index, prompt in enumerate(PROMPT_TEXTS):
    llm.engine.add_request(llm.inputs.process(str(index), prompt, params))
while held(llm) < size * 3 // 4:
    llm.engine.step()
print("holding", flush=True)
time.sleep(120)
"""


@pytest.mark.slow  # an engine in a subprocess, killed
def test_a_killed_engines_pages_return_to_the_pool(tiny_llama, tiny_qwen2, pool_name):
    size = peak_bytes(tiny_qwen2, pool_name) * 5 // 4
    spec = KVPoolSpec(pool_name, size)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tiny_llama), pool_name, str(size)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    try:
        assert holder.stdout.readline().strip() == "holding", "the holding engine did not start"
        llm = on_pool(tiny_qwen2, replace(spec, size_bytes=None), 512)
        pool = llm.engine.scheduler.kv_cache_manager.pool.budget.pool
        assert pool.used_bytes() >= size * 3 // 4  # the other engine holds most of the pool
        holder.kill()  # SIGKILL while its requests hold pages
        holder.wait(timeout=10)
        burst(llm, "after-kill")
        assert llm.stats().num_preemptions == 0  # the whole pool was there for this burst
    finally:
        holder.kill()
