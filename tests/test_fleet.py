"""xPyD in real processes: `kvferry disagg --prefill 2 --decode 2 --policy prefix` over NIXL.

Prompts of two shared prefixes and unrelated ones, streamed and not: every greedy answer
equals the offline colocated engine's, both prefillers and both decoders serve requests
(their prefix-cache queries and the proxy's per-instance counts say so), the prompts that
share a prefix hit it where they were sent, and every block pool is full again.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams
from tests import plain_http
from tests.proxy_fakes import free_port, start_cli
from tests.test_disagg import _disagg_args, _metric, _wait_blocks_free
from tests.test_prefix_routing import READY, answer, known_blocks, prefix_stats

pytestmark = pytest.mark.slow  # four instances and a proxy (make test-all only)

FIRST = " ".join(f"alpha{i}" for i in range(40))
SECOND = " ".join(f"beta{i}" for i in range(40))
TAIL = " and then the old man walked along the long river to the small red house"
PROMPTS = [
    FIRST + " first question" + TAIL,
    SECOND + " first question" + TAIL,
    FIRST + " second question" + TAIL,
    SECOND + " second question" + TAIL,
    "the cat sees a small bird",
    "completely different words about the sea and a boat " * 3,
]


def upstream_counts(proxy: str, role: str) -> dict[str, float]:
    """Requests the proxy sent to each instance of ``role`` (any outcome), from its /metrics."""
    counts: dict[str, float] = {}
    for line in plain_http.get(proxy + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvferry_proxy:upstream_requests_total{") and f'role="{role}"' in line:
            url = line.split('instance="', 1)[1].split('"', 1)[0]
            counts[url] = counts.get(url, 0.0) + float(line.rpartition(" ")[2])
    return counts


def test_two_prefillers_and_two_decoders_answer_as_colocated(tiny_llama: Path, tmp_path: Path) -> None:
    log = tmp_path / "disagg.log"
    args = _disagg_args(tiny_llama, free_port(), tmp_path / "logs", "--policy", "prefix", "--block-size", "4")
    args[args.index("--prefill") + 1] = "2"
    args[args.index("--decode") + 1] = "2"
    proc = start_cli(args, log)
    try:
        llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20, enforce_eager=True, block_size=4)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
        expected = {p: o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}
        deadline = time.monotonic() + 600
        while (ready := READY.search(log.read_text(errors="replace"))) is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        proxy, prefills, decodes = ready.group(1), ready.group(2).split(), ready.group(3).split()
        assert len(prefills) == 2 and len(decodes) == 2
        for i, prompt in enumerate(PROMPTS):
            assert answer(proxy, prompt, stream=i % 2 == 1) == expected[prompt], prompt
            while i == 1 and min(known_blocks(proxy, url) for url in prefills) == 0:
                # the two prefixes went to different prefillers; the proxy learns both
                assert time.monotonic() < deadline, "the proxy never learned the prefixes' blocks"
                time.sleep(0.1)
        for url in [*prefills, *decodes]:
            assert prefix_stats(url)[0] > 0, f"{url} computed no prompt"
        for role, urls in (("prefill", prefills), ("decode", decodes)):
            assert set(upstream_counts(proxy, role)) == set(urls), role
        hits = sum(prefix_stats(url)[1] for url in prefills)
        assert hits >= 2 * (len(FIRST.split()) - 4)  # each second question found its prefix
        read = sum(_metric(url, "kvferry:kv_connector_nixl_bytes_read_total") for url in decodes)
        assert read > 0  # KV moved over NIXL
        for url in [*prefills, *decodes]:
            _wait_blocks_free(url)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
