"""Two `kvferry serve` processes serving different models on one shared KV memory pool
smaller than the sum of their peaks: a burst on one, then a burst on the other, and the
second completes without preemption; two eager servers splitting the same memory in halves
cannot (the second preempts). The ledger is gone once both servers exit; a fake slot planted
in it fails requests with an error naming the pool."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvferry.kv.pool_ledger import NUM_SLOTS, Slot, encode_slot, parse, slot_offset
from kvferry.kv.shared_pool import KVPoolSpec
from tests.pd_support import Server, start_server, stop, wait_healthy, wait_idle

# slow: four `kvferry serve` processes on shared pools (make test-all only)
pytestmark = pytest.mark.slow

POOL = "4MiB"  # one burst of either model fits; both bursts at once would not
HALF = "2MiB"
PROMPTS = [f"the cat {i} sees a dog and the red ball in the morning " * 4 for i in range(24)]
COMMON = ("--dtype", "float32", "--enforce-eager", "--max-num-batched-tokens", "512")


@pytest.fixture(scope="module")
def pool_name() -> Iterator[str]:
    name = f"test-serve-{uuid.uuid4().hex[:8]}"
    yield name
    KVPoolSpec(name).path.unlink(missing_ok=True)


def _start(models: list[Path], logs: Path, tag: str, args: tuple[str, ...]) -> list[Server]:
    servers = [start_server(m, logs, f"{tag}{i}", args=(*COMMON, *args)) for i, m in enumerate(models)]
    wait_healthy(servers)
    return servers


def _burst(server: Server) -> dict[str, float]:
    """Run the burst, every prompt in one request so that all of them are in the engine at
    once whatever its speed (separate requests trickle in from client threads, and a fast
    engine finishes the first before the last arrive); the /metrics sample with the most
    resident KV memory seen meanwhile."""
    body = {"max_tokens": 96, "temperature": 0, "ignore_eos": True, "prompt": PROMPTS}
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(server.post, body, timeout=300)
        peak = server.metrics()
        while not call.done():
            sample = server.metrics()
            if sample["kv_resident_bytes"] > peak["kv_resident_bytes"]:
                peak = sample
        answer = call.result()
    assert answer.status_code == 200, answer.text
    assert [choice["finish_reason"] for choice in answer.json()["choices"]] == ["length"] * len(PROMPTS)
    wait_idle(server)
    return peak


@pytest.mark.parametrize("mode", ["elastic_pool", "eager_halves"])
def test_second_burst_needs_the_first_engines_memory(tiny_llama, tiny_qwen2, tmp_path, pool_name, mode):
    if mode == "elastic_pool":
        args = ("--kv-allocator", "elastic", "--kv-memory-pool", pool_name, "--kv-pool-size", POOL)
    else:
        args = ("--kv-cache-memory", HALF)
    servers = _start([tiny_qwen2, tiny_llama], tmp_path, mode, args)
    try:
        peaks = [_burst(server) for server in servers]  # qwen2's burst, then llama's (the larger)
        metrics = [server.metrics() for server in servers]
        preemptions = metrics[1].get("num_preemptions", 0.0)
        if mode == "elastic_pool":
            assert preemptions == 0
            _check_pool_metrics(peaks, metrics)
        else:
            assert preemptions > 0
            for m in metrics:  # eager: everything committed from the start, no pool
                assert m["kv_resident_bytes"] == m["kv_reserved_bytes"] > 0
                assert m["kv_pool_size_bytes"] == 0
    finally:
        assert stop(servers) == [0, 0]
    if mode == "elastic_pool":
        assert not KVPoolSpec(pool_name).path.exists()  # the last engine to leave removed it


def _check_pool_metrics(peaks: list[dict[str, float]], ends: list[dict[str, float]]) -> None:
    """/metrics of two engines on one pool: during its burst each engine holds pages of the
    pool (resident memory within its share, below its reserved capacity); idle afterwards,
    every page it mapped is returned and the pool is empty."""
    pool_bytes = 4 << 20  # POOL
    for peak, end in zip(peaks, ends, strict=True):
        assert peak["kv_pool_size_bytes"] == end["kv_pool_size_bytes"] == pool_bytes
        assert 0 < peak["kv_resident_bytes"] <= peak["kv_pool_held_bytes"] <= peak["kv_pool_used_bytes"]
        assert peak["kv_pool_used_bytes"] <= pool_bytes
        assert peak["kv_resident_bytes"] < peak["kv_reserved_bytes"]
        assert end["kv_resident_bytes"] == end["kv_pool_held_bytes"] == end["kv_pool_used_bytes"] == 0
        assert end["kv_pages_mapped"] == end["kv_pages_returned"] > 0


def test_a_prompt_larger_than_the_pool_is_a_400_and_the_server_keeps_serving(tiny_llama, tmp_path, pool_name):
    """The pool caps the engine's blocks: a prompt needing more KV than the whole pool is the
    client's error (HTTP 400, OpenAI-style body naming the prompt), not a hang or a 500."""
    tiny_pool = (
        "--kv-allocator",
        "elastic",
        "--kv-memory-pool",
        f"{pool_name}-tiny",
        "--kv-pool-size",
        "288KiB",
    )
    (server,) = _start([tiny_llama], tmp_path, "tiny_pool", tiny_pool)
    try:
        body = {"max_tokens": 4, "temperature": 0}
        refused = server.post({**body, "prompt": [5] * 450})  # 29 blocks of 16; the pool holds 24
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "prompt" and "more KV cache than the engine has" in error["message"]
        assert server.post({**body, "prompt": PROMPTS[0]}).status_code == 200
        wait_idle(server)
        assert server.metrics()["kv_pool_used_bytes"] == 0
        bystander = _plant_fake_slot(KVPoolSpec(f"{pool_name}-tiny"))
        try:  # a slot no engine wrote, holding the rest of the pool: an error, not a wait
            failed = server.post({**body, "prompt": PROMPTS[1]}, timeout=60)
        finally:
            bystander.kill()
            bystander.wait()
        assert failed.status_code == 500, failed.text
        assert f"KV memory pool '{pool_name}-tiny'" in failed.json()["error"]["message"]
        assert "not attached to the pool" in failed.json()["error"]["message"]
    finally:
        assert stop([server]) == [0]
        KVPoolSpec(f"{pool_name}-tiny").path.unlink(missing_ok=True)


def _plant_fake_slot(spec: KVPoolSpec) -> subprocess.Popen:
    """Another process of this user writes a slot for a live process that never joined the
    pool (`sleep`, returned), holding everything the engines do not."""
    bystander = subprocess.Popen(["sleep", "120"])
    started = int(Path(f"/proc/{bystander.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    state = parse(spec.path.read_bytes())
    index = NUM_SLOTS - 1
    fake = encode_slot(index, Slot(bystander.pid, started, state.size_bytes - state.used_bytes))
    with spec.path.open("r+b") as ledger:
        ledger.seek(slot_offset(index))
        ledger.write(fake)
    return bystander
