"""P/D over NIXL with the tiny DeepSeek-V3 (latent attention: one row of kv_lora_rank +
qk_rope_head_dim values per token and layer, the same on every tensor-parallel rank):
outputs equal a colocated engine's; a decoder reads exactly the latent rows of the prompt's
blocks, each block once per decode rank: from one prefill rank however many hold it (TP
(2,1) reads what (1,1) reads, same bytes and descriptors), a TP=2 decoder one copy per
rank; every pool ends all free. Slow: four `kvferry serve` processes, two of them TP=2."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams
from tests.fixtures.tiny_moe import KV_LORA_RANK, QK_ROPE_HEAD_DIM
from tests.pd_support import Server, decode, prefill, serving, tp_matrix, wait_idle

MAX_TOKENS = 8
CHUNK = ("--max-num-batched-tokens", "64", "--enforce-eager")
BLOCK = 16  # kvferry serve's default block size
LAYERS = 3
PAGE = BLOCK * (KV_LORA_RANK + QK_ROPE_HEAD_DIM) * 4  # one layer's block: latent rows, float32
LENGTHS = (17, 40, 90)


def _prompts(seed: int = 5) -> list[list[int]]:
    """Fresh prompts per seed: a decoder that served a prompt before has it cached (no read)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 800, (n,), generator=gen).tolist() for n in LENGTHS]


def _latent_bytes(num_loaded: int) -> int:
    """A decoder loading `num_loaded` prompt tokens reads their blocks' rows in every layer."""
    return -(-num_loaded // BLOCK) * LAYERS * PAGE


@pytest.fixture(scope="module")
def model(tiny_moe: Callable[[str], Path]) -> Path:
    return tiny_moe("deepseek_v3")


def _metric(server: Server, name: str) -> float:
    return server.metrics().get(f"kv_connector_nixl_{name}", 0.0)


def _colocated(model: Path, prompt_sets: list[list[list[int]]]) -> list[list[str]]:
    llm = LLM(
        str(model), dtype="float32", kv_cache_bytes=5 << 20, max_num_batched_tokens=64, enforce_eager=True
    )
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return [[o.outputs[0].text for o in llm.generate(prompts, greedy)] for prompts in prompt_sets]


def _pd_one_by_one(prefiller: Server, decoder: Server, seed: int = 5) -> list[tuple[str, float, float]]:
    """Each prompt through P/D alone: (text, bytes read, descriptors) per prompt."""
    results = []
    for prompt in _prompts(seed):
        read, descs = _metric(decoder, "bytes_read"), _metric(decoder, "descriptors")
        params = prefill(prefiller, prompt)
        resp = decode(decoder, prompt, params, MAX_TOKENS)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
        text = body["choices"][0]["text"]
        results.append((text, _metric(decoder, "bytes_read") - read, _metric(decoder, "descriptors") - descs))
    wait_idle(decoder)
    wait_idle(prefiller)
    return results


@pytest.fixture(scope="module")
def servers(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    with serving(model, tmp_path_factory.mktemp("pd_mla"), tp_matrix(CHUNK)) as started:
        yield started


PAIRS = (("p1", "d1", 1), ("p2", "d1", 1), ("p1", "d2", 2), ("p2", "d2", 2))


@pytest.mark.slow
def test_mla_pd_across_tp_sizes_reads_each_block_once_per_decode_rank(model: Path, servers) -> None:
    """(1,1) is the baseline; (2,1): the same bytes and descriptors (one prefill rank read,
    not both); (1,2) and (2,2): one copy per decode rank (twice the bytes); answers equal a
    colocated engine's. Each pair its own prompts (a decoder keeps what it loaded cached)."""
    expected = _colocated(model, [_prompts(seed) for seed in range(len(PAIRS))])
    base_descs: list[float] = []
    for seed, (prefill_name, decode_name, copies) in enumerate(PAIRS):
        got = _pd_one_by_one(servers[prefill_name], servers[decode_name], seed)
        for length, (text, read, _), want in zip(LENGTHS, got, expected[seed], strict=True):
            assert text == want, (prefill_name, decode_name)
            assert read == copies * _latent_bytes(length - 1), (prefill_name, decode_name, read)
        if decode_name == "d1":  # same layout (NHD) on both sides: the same descriptors
            descs_now = [descs for _, _, descs in got]
            assert not base_descs or descs_now == base_descs, (prefill_name, descs_now, base_descs)
            base_descs = descs_now
