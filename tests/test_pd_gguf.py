"""P/D under --quantization gguf: answers byte-identical to a colocated gguf engine (the
embedded SmolLM2's Q4_1 file).

Every call of a GGUF linear runs the block kernel, whose rows do not depend on the rows
sharing the call, and a layer computes a decode row alike in a pure decode step (the
fused operator: a P/D decoder's steps) and in a step mixed with prefills (the same code in
parts: a colocated engine's steps while other prompts prefill). So the prefiller's prompt
steps and the decoder's one-row step of the prompt's last token compute what a colocated
engine computes. Real processes, real NIXL agents, real HTTP; every pool back to full."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvferry.model.layers.gguf_kernel import gguf_kernel_available
from tests.pd_support import (
    Server,
    ServerSpec,
    colocated_greedy,
    complete,
    nixl,
    proxying,
    serving,
    wait_idle,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not gguf_kernel_available(), reason="no C++ compiler for the CPU kernels"),
]

MAX_TOKENS = 8
STEP_TOKENS = 256  # a 200-token prompt is one prefill step of 200 rows
# 64 MiB of KV (a later --kv-cache-memory wins over the helper's 5 MiB): SmolLM2 takes 46 KB a token
ARGS = ("--quantization", "gguf", "--max-num-batched-tokens", str(STEP_TOKENS), "--kv-cache-memory", "0.0625")
LENGTHS = (17, 90, 200)  # colocated, together: the 200-token prompt's prefill mixes with decodes


@pytest.fixture(scope="module")
def servers(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    specs = {"p": ServerSpec(nixl("producer"), args=ARGS), "d": ServerSpec(nixl("consumer"), args=ARGS)}
    with serving(smollm2_gguf, tmp_path_factory.mktemp("pd_gguf_logs"), specs) as started:
        yield started


def test_gguf_pd_through_the_proxy_equals_a_colocated_gguf_engine(
    smollm2_gguf: Path, servers: dict[str, Server], tmp_path: Path
) -> None:
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(10, 800, (n,), generator=gen).tolist() for n in LENGTHS]
    expected = colocated_greedy(
        smollm2_gguf,
        prompts,
        MAX_TOKENS,
        quantization="gguf",
        max_num_batched_tokens=STEP_TOKENS,
        kv_cache_bytes=64 << 20,
    )
    with proxying({"gguf": (servers["p"], servers["d"])}, tmp_path) as urls:
        for stream in (False, True):
            for prompt, want in zip(prompts, expected, strict=True):
                answer = complete(urls["gguf"], prompt, MAX_TOKENS, stream)
                assert answer.cached in (None, len(prompt) - 1)  # the prompt's KV came over NIXL
                assert answer.token_ids == list(want.token_ids), (stream, len(prompt))
                assert answer.text == want.text
    for server in servers.values():
        wait_idle(server)
