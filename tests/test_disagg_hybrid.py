"""`kvferry disagg` with hybrid models (tiny Gemma 3: sliding and full layers in shared
tensors; tiny Gemma 4: KV-shared layers, wider global heads, padded sliding pages): real
prefill, decode and proxy processes, real NIXL agents, real HTTP. Gemma 4 at prefill/decode
TP (1,1), (1,2), (2,1) and Gemma 3 at (1,2), across both KV layouts (Gemma 3 at (1,1) and
(2,1) is tests/test_pd_hybrid.py's, on hand-started servers): greedy answers through the proxy are
byte-identical to a colocated engine; a request's decoder reads exactly the blocks each
group's window shows its next token (its /metrics), KV-shared layers once; both pools end
all free and SIGTERM stops everything cleanly.

One deployment at a time (2 cores), eager forward everywhere (compiling the captured
decode step would take most of each start; the colocated reference is eager too)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams
from tests import plain_http
from tests.fixtures.tiny_hybrid import WINDOW
from tests.pd_support import prompt_set
from tests.proxy_fakes import free_port, start_cli

# slow: `kvferry disagg` deployments for two hybrid models (make test-all only)
pytestmark = pytest.mark.slow

MODEL = "tiny"
MAX_TOKENS = 12
BLOCK = 16  # kvferry's default block size
READY = re.compile(r"proxy ready at (\S+) \(prefill: (\S+); decode: (\S+);")
ENGINE_ARGS = ["--kv-cache-memory", "0.005", "--max-num-batched-tokens", "64", "--enforce-eager"]

# (model, prefill TP, decode TP, layout)
# Gemma 3 at TP (1,1) and (2,1), NHD, runs on tests/test_pd_hybrid.py's shared servers.
DEPLOYMENTS = [
    ("gemma3", 1, 2, "HND"),
    ("gemma4", 1, 1, "HND"),
    ("gemma4", 1, 2, "NHD"),
    ("gemma4", 2, 1, "HND"),
]


def _visible_blocks(num_loaded: int) -> tuple[int, int]:
    """(full group's blocks, one sliding group's blocks) a decoder reads for `num_loaded`
    prompt tokens: every block, and those the next token's window sees."""
    full = -(-num_loaded // BLOCK)
    return full, full - max(0, num_loaded - WINDOW + 1) // BLOCK


def gemma3_bytes(num_loaded: int) -> int:
    """3 groups (2 sliding) of 2 layers; a page: 2 KV heads of 16 floats, K and V."""
    full, sliding = _visible_blocks(num_loaded)
    return (full + 2 * sliding) * 2 * (BLOCK * 2 * 16 * 4 * 2)


def gemma4_bytes(num_loaded: int) -> int:
    """5 groups (4 sliding) of 1 layer owning KV (3 more read others' KV and add nothing); a
    page: 2 KV heads stored as 32 floats (sliding heads of 16 padded), K and V."""
    full, sliding = _visible_blocks(num_loaded)
    return (full + 4 * sliding) * (BLOCK * 2 * 32 * 4 * 2)


EXPECTED_BYTES = {"gemma3": gemma3_bytes, "gemma4": gemma4_bytes}


@pytest.fixture(scope="module")
def models(tiny_gemma3: Path, tiny_gemma4: Path) -> dict[str, Path]:
    return {"gemma3": tiny_gemma3, "gemma4": tiny_gemma4}


@pytest.fixture(scope="module")
def prompts(models: dict[str, Path]) -> list[str | list[int]]:
    """8 of the P/D prompt set: below a block, exact multiples, long ones (chunked prefill)."""
    every = prompt_set(AutoTokenizer.from_pretrained(models["gemma3"]))
    return [every[i] for i in (0, 3, 5, 6, 7, 9, 12, 15)]


@pytest.fixture(scope="module")
def reference(models: dict[str, Path], prompts: list) -> Iterator[dict[str, list[str]]]:
    cache: dict[str, list[str]] = {}

    def get(arch: str) -> list[str]:
        if arch not in cache:
            llm = LLM(
                str(models[arch]), kv_cache_bytes=5 << 20, max_num_batched_tokens=64, enforce_eager=True
            )
            outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
            cache[arch] = [o.outputs[0].text for o in outs]
            llm.engine.shutdown()
        return cache[arch]

    yield get


class Deployment:
    """`kvferry disagg` (1 prefill, 1 decode, the proxy), started and ready."""

    def __init__(self, model: Path, prefill_tp: int, decode_tp: int, layout: str, tmp: Path) -> None:
        self.log = tmp / "disagg.log"
        args = ["--log-level", "INFO", "disagg", str(model), "--prefill-tp", str(prefill_tp)]
        args += ["--decode-tp", str(decode_tp), "--kv-layout", layout, "--port", str(free_port())]
        args += ["--log-dir", str(tmp / "logs"), "--served-model-name", MODEL, *ENGINE_ARGS]
        self.proc = start_cli(args, self.log)
        self.proxy, self.prefill, self.decode = self._wait_ready()

    def _wait_ready(self, timeout: float = 240.0) -> tuple[str, str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = READY.search(self.log.read_text(errors="replace"))
            if match:
                return match.groups()
            if self.proc.poll() is not None:
                pytest.fail(f"disagg exited with {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.2)
        pytest.fail(f"disagg not ready after {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def complete(self, prompt: str | list[int]) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        resp = plain_http.post(self.proxy + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return -9


def metric(url: str, name: str) -> float:
    for line in plain_http.get(url + "/metrics", timeout=10).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] == name:
            return float(value)
    return 0.0


def wait_all_free(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(url, "kvferry:num_free_blocks") != metric(url, "kvferry:num_blocks"):
        assert time.monotonic() < deadline, f"KV blocks of {url} not freed"
        time.sleep(0.1)


BYTES_READ = "kvferry:kv_connector_nixl_bytes_read_total"


@pytest.mark.parametrize(("arch", "prefill_tp", "decode_tp", "layout"), DEPLOYMENTS)
def test_disagg_hybrid_equals_colocated_and_reads_the_window_visible_blocks(
    models, prompts, reference, tmp_path, arch, prefill_tp, decode_tp, layout
) -> None:
    expected = reference(arch)
    deployment = Deployment(models[arch], prefill_tp, decode_tp, layout, tmp_path)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(deployment.complete, prompts))
        for prompt, answer, want in zip(prompts, answers, expected, strict=True):
            assert answer == want, prompt
        # One request at a time, fresh tokens (no local prefix hit): the decoder reads the
        # prompt's KV but the last token's (it computes that one itself).
        gen = torch.Generator().manual_seed(prefill_tp * 10 + decode_tp)
        for length in (73, 161):
            prompt = torch.randint(10, 800, (length,), generator=gen).tolist()
            before = metric(deployment.decode, BYTES_READ)
            deployment.complete(prompt)
            read = metric(deployment.decode, BYTES_READ) - before
            assert read == EXPECTED_BYTES[arch](length - 1), (length, read)
        wait_all_free(deployment.prefill)
        wait_all_free(deployment.decode)
    finally:
        code = deployment.stop()
    assert code == 0, deployment.tail()
    assert "all stopped" in deployment.log.read_text()
