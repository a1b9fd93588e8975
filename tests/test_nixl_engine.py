"""Two engine cores in one process, both kv_role "both", real NIXL agents: P/D without HTTP.

Each engine prefills for the other and decodes what the other prefilled; outputs equal a
colocated engine's, stats count the transfers, and both pools end all free. The cores run
eager: the subject is the transfer, the compiled forward is tests/test_capture.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    KVTransferConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kvferry.engine.core import EngineCore
from kvferry.messages.engine_core import EngineCoreOutput, EngineCoreRequest
from kvferry.model.resolve import resolve_model_config
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, tokenize_all


def _config(model_dir: Path, kv: KVTransferConfig | None, layout: str, tp: int = 1) -> EngineConfig:
    model = resolve_model_config(str(model_dir), dtype="float32", max_model_len=512)
    cache = CacheConfig(block_size=16, kv_cache_bytes=8 << 20, layout=layout)
    return EngineConfig(
        model=model,
        cache=cache,
        scheduler=SchedulerConfig(64, 16, True),
        parallel=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer=kv or KVTransferConfig(),
        compilation=CompilationConfig(enforce_eager=True),
    )


@pytest.fixture(scope="module")
def engines(tiny_qwen2: Path) -> Iterator[tuple[EngineCore, EngineCore, EngineCore]]:
    both = KVTransferConfig("NixlConnector", kv_role="both", kv_connector_extra_config={"lease_s": 20})
    cores = (
        EngineCore(_config(tiny_qwen2, both, "NHD")),
        EngineCore(_config(tiny_qwen2, both, "HND")),
        EngineCore(_config(tiny_qwen2, None, "NHD")),
    )
    yield cores
    for core in cores:
        core.shutdown()


def _run(
    engine: EngineCore, requests: list[EngineCoreRequest], other: EngineCore | None = None
) -> tuple[dict[str, list[int]], dict[str, EngineCoreOutput]]:
    """Step `engine` until its requests finish, stepping `other` too (it serves the leases)."""
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {r.req_id: [] for r in requests}
    finals: dict[str, EngineCoreOutput] = {}
    deadline = time.monotonic() + 60
    while len(finals) < len(requests):
        assert time.monotonic() < deadline, "requests did not finish"
        for out in engine.step():
            tokens[out.req_id] += out.new_token_ids
            if out.finished:
                assert out.error is None, out.error
                finals[out.req_id] = out
        if other is not None and other.has_unfinished_requests():
            other.step()
    return tokens, finals


def _first_output(core: EngineCore, request: EngineCoreRequest, other: EngineCore | None = None):
    """Add `request` and step (and `other`, the remote side) until its one output comes."""
    core.add_request(request)
    deadline, outputs = time.monotonic() + 20, []
    while not outputs:
        assert time.monotonic() < deadline
        outputs = core.step()
        if other is not None and other.has_unfinished_requests():
            other.step()
    (out,) = outputs
    return out


def _drain(*cores: EngineCore) -> None:
    deadline = time.monotonic() + 20
    while any(c.has_unfinished_requests() for c in cores):
        assert time.monotonic() < deadline, "KV transfers still pending"
        for core in cores:
            if core.has_unfinished_requests():
                core.step()
    for core in cores:
        stats = core.stats()
        assert stats.num_free_blocks == stats.num_blocks, f"{stats.num_blocks - stats.num_free_blocks} leaked"


def _pd_round(prefiller: EngineCore, decoder: EngineCore, colocated: EngineCore, prompts, tag: str) -> None:
    """Prefill every prompt on one engine, decode on the other: equal to the colocated engine."""
    transfers_before = decoder.stats().kv_connector.get("nixl_transfers", 0)
    one = SamplingParams(max_tokens=1, temperature=0)
    params = SamplingParams(max_tokens=8, temperature=0)
    now = time.time()
    _, prefilled = _run(
        prefiller,
        [
            EngineCoreRequest(f"{tag}-p{i}", p, one, now, {"do_remote_decode": True})
            for i, p in enumerate(prompts)
        ],
        decoder,
    )
    decoded, finals = _run(
        decoder,
        [
            EngineCoreRequest(f"{tag}-d{i}", p, params, now, prefilled[f"{tag}-p{i}"].kv_transfer_params)
            for i, p in enumerate(prompts)
        ],
        prefiller,
    )
    expected, _ = _run(
        colocated,
        [EngineCoreRequest(f"{tag}-c{i}", p, params, now) for i, p in enumerate(prompts)],
    )
    for i, prompt in enumerate(prompts):
        assert decoded[f"{tag}-d{i}"] == expected[f"{tag}-c{i}"]
        assert finals[f"{tag}-d{i}"].num_cached_tokens == len(prompt) - 1
    assert decoder.stats().kv_connector["nixl_transfers"] > transfers_before  # this round read over NIXL


@pytest.mark.parametrize("direction", ["nhd_to_hnd", "hnd_to_nhd"])
def test_both_roles_prefill_and_decode_for_each_other(engines, tiny_qwen2, direction):
    first, second, colocated = engines
    prefiller, decoder = (first, second) if direction == "nhd_to_hnd" else (second, first)
    # prompts of this direction only: the other direction's decoder prefilled its own
    lead = 5 if direction == "nhd_to_hnd" else 6
    prompts = [[lead, *prompt] for prompt in tokenize_all(tiny_qwen2, PROMPT_TEXTS)]
    before = decoder.stats()
    _pd_round(prefiller, decoder, colocated, prompts, tag=direction[:3])
    after = decoder.stats()  # every prompt's KV crossed NIXL, none came from the decoder's cache
    assert after.prefix_cache_hits == before.prefix_cache_hits
    transfers = after.kv_connector["nixl_transfers"] - before.kv_connector.get("nixl_transfers", 0)
    assert transfers == len(prompts)
    _drain(prefiller, decoder)


def test_incompatible_model_is_a_client_error(engines, tiny_qwen2, tiny_llama):
    """A decoder serving another model refuses the params: clear message, HTTP 400 kind."""
    prefiller = engines[0]
    kv = KVTransferConfig("NixlConnector", kv_role="consumer")
    other = EngineCore(_config(tiny_llama, kv, "NHD"))
    try:
        prompt = tokenize_all(tiny_qwen2, PROMPT_TEXTS[:1])[0]
        one = SamplingParams(max_tokens=1, temperature=0)
        _, prefilled = _run(
            prefiller, [EngineCoreRequest("cmp-p", prompt, one, time.time(), {"do_remote_decode": True})]
        )
        params = prefilled["cmp-p"].kv_transfer_params
        out = _first_output(other, EngineCoreRequest("cmp-d", prompt, one, time.time(), params))
        assert out.invalid_param == "kv_transfer_params" and "incompatible" in out.error, out.error
        _drain(other)
    finally:
        other.shutdown()
    # The prefill is still held (nobody read it): a genuine decoder can still have it.
    _run(engines[1], [EngineCoreRequest("cmp-d2", prompt, one, time.time(), params)], prefiller)
    _drain(prefiller, engines[1])


def test_release_kv_frees_a_prefill_nobody_will_read(engines, tiny_qwen2):
    """The engine's release (the proxy's client left): the prefiller's pool is all free at
    once, not at lease expiry; a decoder that still shows up gets a load failure."""
    prefiller, decoder = engines[0], engines[1]
    prompt = tokenize_all(tiny_qwen2, PROMPT_TEXTS[:1])[0]
    one = SamplingParams(max_tokens=1, temperature=0)
    _, prefilled = _run(
        prefiller, [EngineCoreRequest("rel-p", prompt, one, time.time(), {"do_remote_decode": True})]
    )
    assert prefiller.stats().num_free_blocks < prefiller.stats().num_blocks  # held for a decoder
    start = time.monotonic()
    prefiller.release_kv(["rel-p", "never-held"])  # unknown ids are ignored
    _drain(prefiller)
    assert time.monotonic() - start < 2.0  # the lease is 20 s
    prefiller.release_kv(["rel-p"])  # idempotent
    params = prefilled["rel-p"].kv_transfer_params
    out = _first_output(decoder, EngineCoreRequest("rel-d", prompt, one, time.time(), params), prefiller)
    assert out.error is not None and "loading the request's KV cache failed" in out.error, out.error
    _drain(prefiller, decoder)
