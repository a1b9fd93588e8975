"""--policy prefix: the proxy's index follows the instances' KV events, hashes prompts as the
engine does, and sends a request to the instance holding its longest prefix, weighed
against load."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio

from kvferry.config import KVEventsConfig
from kvferry.engine.input_processor import InputProcessor
from kvferry.engine.kv_event_publisher import KVEventPublisher
from kvferry.entrypoints.proxy.kv_event_feed import EventFeed, EventSource
from kvferry.entrypoints.proxy.pool import Instance
from kvferry.entrypoints.proxy.prefix_index import PrefixIndex, RouteKey
from kvferry.entrypoints.proxy.prefix_route import CHAT, PrefixAware, PromptHasher
from kvferry.model.resolve import resolve_model_config
from kvferry.model.tokenizer import load_tokenizer
from kvferry.sampling_params import SamplingParams
from kvferry.scheduler.hashing import BlockHasher
from kvferry.scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvferry.scheduler.request import Request
from tests import plain_http
from tests.proxy_fakes import FakeInstance, free_port, serve_in_thread, start_cli

H = [bytes([i]) * 32 for i in range(8)]


def stored(hashes: list[bytes], block_size: int = 4) -> BlockStored:
    return BlockStored(hashes, None, list(range(block_size * len(hashes))), block_size, None, "CPU")


def test_index_follows_stores_removals_clears_and_stays_bounded():
    index = PrefixIndex(block_size=4, max_blocks=3)
    index.apply("a", KVEventBatch(0.0, [stored(H[:3]), BlockRemoved([H[1]], "CPU")]))
    assert index.cached_blocks("a", H[:3]) == 1  # the prefix breaks at the removed block
    index.apply("a", KVEventBatch(0.0, [stored([H[1], H[3]])]))  # 4 blocks: the oldest (H[0]) goes
    assert index.num_blocks("a") == 3 and index.cached_blocks("a", H[:3]) == 0
    index.apply("a", KVEventBatch(0.0, [stored(H[5:6], block_size=16)]))  # another block size: ignored
    assert index.num_mismatched == 1 and index.cached_blocks("a", H[5:6]) == 0
    index.apply("a", KVEventBatch(0.0, [AllBlocksCleared()]))
    assert index.num_blocks("a") == 0


def test_proxy_metrics_export_the_blocks_the_index_knows_per_instance():
    from prometheus_client import generate_latest

    from kvferry.entrypoints.proxy.metrics import ProxyMetrics
    from kvferry.entrypoints.proxy.pool import InstancePool, RoundRobin

    index = PrefixIndex(block_size=4)
    index.apply("http://a", KVEventBatch(0.0, [stored(H[:3])]))
    pool = InstancePool("prefill", ["http://a", "http://b"], RoundRobin())
    text = generate_latest(ProxyMetrics([pool], index.num_blocks).registry).decode()
    assert 'kvferry_proxy:instance_cached_blocks{instance="http://a",role="prefill"} 3.0' in text
    assert 'kvferry_proxy:instance_cached_blocks{instance="http://b",role="prefill"} 0.0' in text
    assert "instance_cached_blocks" not in generate_latest(ProxyMetrics([pool]).registry).decode()


def test_policy_prefers_the_longest_prefix_until_load_outweighs_it():
    index = PrefixIndex(block_size=4)
    a, b = Instance("a", "prefill"), Instance("b", "prefill")
    index.apply("b", KVEventBatch(0.0, [stored(H[:4])]))
    policy = PrefixAware(index, load_tokens=8)
    route = RouteKey(num_tokens=20, block_hashes=tuple(H[:5]))
    assert policy.pick([a, b], [a, b], route) is b  # cost a: 20, b: 4
    b.in_flight = 2  # b: 4 + 16 = 20 = a's 20: a tie goes to the less loaded
    assert policy.pick([a, b], [a, b], route) is a
    b.in_flight = 1
    assert policy.pick([a, b], [a, b], route) is b
    b.in_flight = 0
    assert policy.pick([a, b], [a, b], None) is a  # nothing known: round-robin after b
    assert policy.pick([a, b], [a, b], None) is b


@pytest.fixture(scope="module")
def inputs(tiny_llama: Path) -> InputProcessor:
    model = resolve_model_config(str(tiny_llama), dtype="float32")
    return InputProcessor(model, load_tokenizer(model))


def test_prompt_hashes_equal_the_engines(inputs: InputProcessor):
    hasher = PromptHasher(inputs, block_size=4)
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "a cat"}]
    key = hasher.route_key(CHAT, {"model": "m", "messages": messages})
    tokens = inputs.tokenize(inputs.apply_chat_template(messages))  # what the server runs
    request = Request("r", tokens, SamplingParams(max_tokens=1), (), 512, block_hasher=BlockHasher(4))
    assert key is not None and key.num_tokens == len(tokens)
    assert list(key.block_hashes) == request.block_hashes and len(key.block_hashes) == len(tokens) // 4
    text = hasher.route_key("/v1/completions", {"model": "m", "prompt": "the red ball"})
    assert text is not None and text.num_tokens == len(inputs.tokenize("the red ball"))
    assert hasher.route_key(CHAT, {"model": "m", "messages": "not a list"}) is None  # the instance says why


def test_feed_replays_gaps_and_relearns_after_a_restart(tmp_path: Path):
    """A real publisher: batches sent before the feed listened come from the replay; a new
    run of the instance (seen by the health checks) wipes what was known of it."""

    def publisher(name: str) -> KVEventPublisher:
        return KVEventPublisher(
            KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=f"ipc://{tmp_path}/{name}",
                replay_endpoint=f"ipc://{tmp_path}/{name}-replay",
            )
        )

    async def scenario() -> None:
        index = PrefixIndex(block_size=4)
        source = EventSource.parse("http://a", f"ipc://{tmp_path}/pub,ipc://{tmp_path}/pub-replay")
        ctx = zmq.asyncio.Context()
        first = publisher("pub")
        first.publish([stored(H[:2])])  # before the feed: only the replay has it
        while first.num_published < 1:
            await asyncio.sleep(0.01)
        restarts = [0]  # what the proxy's health checks saw
        feed = EventFeed(source, index, ctx, runs=lambda: restarts[0])
        task = asyncio.create_task(feed.run())
        while feed.num_batches < 2:  # the live batch 1 makes the feed replay batch 0
            first.publish([stored(H[2:3])])
            await asyncio.sleep(0.05)
        assert index.cached_blocks("http://a", H[:3]) == 3 and feed.num_resets == 0
        first.shutdown()
        second = publisher("pub")  # the instance restarted: sequence numbers from 0
        restarts[0] = 1
        while feed.num_resets == 0:
            second.publish([stored(H[4:5])])
            await asyncio.sleep(0.05)
        while index.num_blocks("http://a") == 0:
            await asyncio.sleep(0.05)
        assert index.cached_blocks("http://a", H[:3]) == 0 and index.cached_blocks("http://a", H[4:5]) == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        second.shutdown()
        ctx.term()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_disagg_gives_each_instance_its_own_event_endpoints_and_the_proxy_them(tmp_path: Path):
    import argparse

    from kvferry.entrypoints import disagg
    from kvferry.entrypoints.proxy.main import add_args, config_from_args

    parser = argparse.ArgumentParser()
    disagg.add_args(parser)
    args = parser.parse_args(["m", "--prefill", "2", "--policy", "prefix", "--kv-connector", "none"])
    args.cpu_split = "none"
    instances = disagg.plan_instances(args, {}, tmp_path, shared={})
    configs = [json.loads(c.cmd[c.cmd.index("--kv-events-config") + 1]) for c in instances]
    endpoints = [(c["endpoint"], c["replay_endpoint"]) for c in configs]
    assert len({e for pair in endpoints for e in pair}) == 6  # own ports for each
    assert all(c["bind"] and c["endpoint"].startswith("tcp://127.0.0.1:") for c in configs)
    proxy = disagg.plan_proxy(args, instances, tmp_path, {})
    proxy_parser = argparse.ArgumentParser()
    add_args(proxy_parser)
    proxy_args = proxy_parser.parse_args(proxy.cmd[proxy.cmd.index("proxy") + 1 :])
    config = config_from_args(proxy_args)
    assert config.policy == "prefix" and config.tokenizer == "m"
    assert config.prefill_kv_events == tuple(f"{p},{r}" for p, r in endpoints[:2])
    assert config.decode_kv_events == (f"{endpoints[2][0]},{endpoints[2][1]}",)


# ---- per-request disaggregation ----------------------------------------------------------


@contextlib.contextmanager
def fake_pd(tiny_llama: Path, **options: Any) -> Iterator[tuple[FakeInstance, FakeInstance, str]]:
    """A fake prefill and a fake decode instance behind a real proxy (--policy prefix,
    --local-prefill-tokens 8 and `options`): the two instances and the proxy's URL."""
    from kvferry.entrypoints.proxy.app import build_app
    from kvferry.entrypoints.proxy.config import ProxyConfig

    prefill, decode = FakeInstance("p"), FakeInstance("d")
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serve_in_thread(inst.app)) for inst in (prefill, decode)]
        config = ProxyConfig(
            (urls[0],),
            (urls[1],),
            policy="prefix",
            tokenizer=str(tiny_llama),
            block_size=4,
            local_prefill_tokens=8,
            **options,
        )
        yield prefill, decode, stack.enter_context(serve_in_thread(build_app(config)))


def ask(proxy: str, prompt: str, stream: bool = False) -> None:
    """A short completion through the proxy, answered HTTP 200."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 3, "stream": stream}
    resp = plain_http.post(proxy + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200 and ("data: [DONE]" in resp.text) == stream


def test_short_prompts_are_prefilled_by_the_decoder_and_long_ones_transferred(tiny_llama: Path):
    """--local-prefill-tokens 8: a prompt of a few tokens goes straight to the decoder (no
    prefill request, so no KV transfer), a long one through the prefiller; /metrics counts
    both paths."""
    with fake_pd(tiny_llama) as (prefill, decode, proxy):
        ask(proxy, "the cat")
        ask(proxy, "a dog", stream=True)
        assert prefill.requests == []  # no prefill, no transfer
        assert [r["prompt"] for r in decode.requests] == ["the cat", "a dog"]
        assert all("kv_transfer_params" not in r for r in decode.requests)
        ask(proxy, " ".join(["the old man reads a golden book by the sea"] * 3))
        assert len(prefill.requests) == 1 and prefill.requests[0]["kv_transfer_params"]["do_remote_decode"]
        assert decode.requests[-1]["kv_transfer_params"]["remote_request_id"] == "p-0"  # transferred
        metrics = plain_http.get(proxy + "/metrics", timeout=10).text
        assert 'kvferry_proxy:prefill_path_total{path="local"} 2.0' in metrics
        assert 'kvferry_proxy:prefill_path_total{path="remote"} 1.0' in metrics


SHARED = " ".join(f"word{i}" for i in range(60))  # a long system prompt shared by the requests
READY = re.compile(r"proxy ready at (\S+) \(prefill: ([^;]+); decode: ([^;]+);")


def prefix_stats(url: str) -> tuple[float, float]:
    """An instance's prefix cache (queried, hit) prompt tokens, from its /metrics."""
    values = {}
    for line in plain_http.get(url + "/metrics", timeout=10).text.splitlines():
        for name in ("prefix_cache_queries", "prefix_cache_hits"):
            if line.startswith(f"kvferry:{name}") and not line.startswith("#"):
                values[name] = float(line.rpartition(" ")[2])
    return values["prefix_cache_queries"], values["prefix_cache_hits"]


def known_blocks(proxy: str, url: str) -> int:
    health = plain_http.get(proxy + "/health", timeout=10).json()
    return next(i["cached_blocks"] for i in health["instances"]["prefill"] if i["url"] == url)


def answer(proxy: str, prompt: str, stream: bool = False) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}
    resp = plain_http.post(proxy + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    if not stream:
        return str(resp.json()["choices"][0]["text"])
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


@pytest.mark.slow
def test_disagg_routes_by_prefix_and_prefills_short_prompts_on_the_decoder(tiny_llama: Path, tmp_path: Path):
    """`kvferry disagg --prefill 2 --decode 1 --policy prefix --local-prefill-tokens 8` over
    NIXL. A short prompt, and a long one the decoder already holds, are prefilled by the
    decoder, other long ones transferred, every greedy
    answer (streamed too) equal to the offline colocated engine's. Requests sharing a long
    prefix go to the prefiller that holds it (its prefix-cache hits prove it, the other sees
    nothing); a new prefix goes to the other. Every block pool is full again."""
    import os
    import signal

    from kvferry.engine.llm import LLM
    from tests.test_disagg import _disagg_args, _metric, _wait_blocks_free

    short = "the cat"
    # Suffixes longer than --local-prefill-tokens: once the decoder holds the prefix (it
    # caches the KV it loaded), a short suffix would be prefilled there instead.
    tail = " about the long river, the old mountain road and the small red house"
    shared = [
        SHARED + " first question" + tail,
        SHARED + " second question" + tail,
        SHARED + " a third" + tail,
    ]
    other = "completely different words about the sea and a boat " * 3
    log = tmp_path / "disagg.log"
    extra = ("--policy", "prefix", "--local-prefill-tokens", "8", "--block-size", "4")  # eager: _disagg_args
    args = _disagg_args(tiny_llama, free_port(), tmp_path / "logs", *extra)
    args[args.index("--prefill") + 1] = "2"
    proc = start_cli(args, log)
    try:
        llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20, enforce_eager=True, block_size=4)
        prompts = [short, *shared, other]
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
        expected = {p: o.outputs[0].text for p, o in zip(prompts, outs)}
        deadline = time.monotonic() + 600
        while (ready := READY.search(log.read_text(errors="replace"))) is None:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        proxy, prefills, decode = ready.group(1), ready.group(2).split(), ready.group(3).strip()
        assert answer(proxy, short) == answer(proxy, short, stream=True) == expected[short]
        assert all(prefix_stats(url)[0] == 0 for url in prefills)  # the decoder computed it

        assert answer(proxy, shared[0]) == expected[shared[0]]
        before = {url: prefix_stats(url) for url in prefills}
        holder = next(url for url in prefills if before[url][0] > 0)
        spare = next(url for url in prefills if url != holder)
        assert before[spare][0] == 0
        while known_blocks(proxy, holder) == 0:  # the proxy learned its blocks
            assert time.monotonic() < deadline, "the proxy never learned the first prompt's blocks"
            time.sleep(0.1)
        assert answer(proxy, shared[1]) == expected[shared[1]]
        assert answer(proxy, shared[2], stream=True) == expected[shared[2]]
        after = {url: prefix_stats(url) for url in prefills}
        assert after[holder][1] - before[holder][1] >= 2 * (len(SHARED.split()) - 4)  # both hit
        assert after[spare] == before[spare]  # nothing went to the other prefiller
        assert answer(proxy, other) == expected[other]  # no hit anywhere: the idle one
        assert prefix_stats(spare)[0] > 0
        queried = {url: prefix_stats(url)[0] for url in prefills}
        assert answer(proxy, shared[0]) == expected[shared[0]]  # cached on the decoder: local
        assert {url: prefix_stats(url)[0] for url in prefills} == queried

        metrics = plain_http.get(proxy + "/metrics", timeout=10).text
        assert 'prefill_path_total{path="local"} 3.0' in metrics
        assert 'prefill_path_total{path="remote"} 4.0' in metrics
        assert _metric(decode, "kvferry:kv_connector_nixl_bytes_read_total") > 0
        for url in [*prefills, decode]:
            _wait_blocks_free(url)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


@pytest.mark.slow
def test_disagg_answers_short_prompts_whole_on_the_prefiller_too(tiny_llama: Path, tmp_path: Path):
    """`kvferry disagg --local-prefill-tokens 64 --local-on-prefillers`, real processes over
    NIXL: short prompts sent together are answered by both instances, the prefiller's
    whole (prefill and decode); every greedy answer, streamed or not, equals the offline
    colocated engine's, nothing is transferred, and both block pools are full again."""
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    from kvferry.engine.llm import LLM
    from tests.test_disagg import _disagg_args, _metric, _wait_blocks_free, _wait_ready

    extra = ("--policy", "prefix", "--local-prefill-tokens", "64", "--block-size", "4")
    args = _disagg_args(tiny_llama, free_port(), tmp_path / "logs", *extra, "--local-on-prefillers")
    log = tmp_path / "disagg.log"
    proc = start_cli(args, log)
    try:
        prompts = [f"the {word} sat by the river and" for word in ("cat", "dog", "bird", "fox", "owl", "cow")]
        llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20, enforce_eager=True, block_size=4)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
        expected = [o.outputs[0].text for o in outs]
        proxy, prefill, decode = _wait_ready(proc, log, 600).groups()
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(
                pool.map(lambda i: answer(proxy, prompts[i], stream=i % 2 == 1), range(len(prompts)))
            )
        assert answers == expected
        metrics = plain_http.get(proxy + "/metrics", timeout=10).text
        paths = dict(re.findall(r'prefill_path_total\{path="(\w+)"\} (\S+)', metrics))
        assert set(paths) == {"local", "local_on_prefiller"}, paths
        assert float(paths["local"]) + float(paths["local_on_prefiller"]) == len(prompts)
        assert _metric(decode, "kvferry:kv_connector_nixl_bytes_read_total") == 0
        for url in (prefill, decode):
            _wait_blocks_free(url)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


def test_an_idle_decoder_prefills_while_every_prefiller_is_busy() -> None:
    """--idle-decoder-prefills: a leg goes local only while every healthy prefiller has a
    prefill in flight and a healthy decoder has nothing in flight; off, never."""
    from kvferry.entrypoints.proxy.pd import ProxyContext, prefills_locally
    from kvferry.entrypoints.proxy.pool import InstancePool, make_policy

    prefill = InstancePool("prefill", ["http://p0", "http://p1"], make_policy("round_robin"))
    decode = InstancePool("decode", ["http://d0", "http://d1"], make_policy("least_loaded"))
    ctx = ProxyContext(prefill, decode, None, None, idle_decoder_prefills=True)  # type: ignore[arg-type]
    assert not prefills_locally(ctx, None)  # a prefiller is free
    prefill.acquire()
    assert not prefills_locally(ctx, None)  # the other still is
    prefill.acquire()
    assert prefills_locally(ctx, None)  # both busy, both decoders idle
    decode.acquire()
    assert prefills_locally(ctx, None)  # d1 is still idle
    decode.acquire()
    assert not prefills_locally(ctx, None)  # no idle decoder
    decode.instances[1].healthy = False
    decode.release(decode.instances[1])
    assert not prefills_locally(ctx, None)  # the idle decoder is down
    prefill.instances[0].healthy = False
    prefill.release(prefill.instances[0])
    decode.release(decode.instances[0])
    assert prefills_locally(ctx, None)  # the healthy prefiller busy, d0 idle
    ctx.idle_decoder_prefills = False
    assert not prefills_locally(ctx, None)


def test_a_local_leg_goes_whole_to_a_prefiller_less_busy_than_every_decoder() -> None:
    """--local-on-prefillers: a leg sent local is answered whole by a prefiller when one has
    fewer requests in flight than every healthy decoder (or none is healthy); off, never."""
    from kvferry.entrypoints.proxy.pd import ProxyContext, prefiller_takes_local_leg
    from kvferry.entrypoints.proxy.pool import InstancePool, make_policy

    prefill = InstancePool("prefill", ["http://p0", "http://p1"], make_policy("least_loaded"))
    decode = InstancePool("decode", ["http://d0", "http://d1"], make_policy("least_loaded"))
    ctx = ProxyContext(prefill, decode, None, None, local_on_prefillers=True)  # type: ignore[arg-type]
    assert not prefiller_takes_local_leg(ctx)  # all idle: the decoders take it
    decode.acquire()
    assert not prefiller_takes_local_leg(ctx)  # d1 is still idle
    decode.acquire()
    assert prefiller_takes_local_leg(ctx)  # every decoder busy, the prefillers idle
    prefill.acquire()
    assert prefiller_takes_local_leg(ctx)  # p1 is idle
    prefill.acquire()
    assert not prefiller_takes_local_leg(ctx)  # one each everywhere: a tie goes to the decoders
    decode.instances[0].healthy = decode.instances[1].healthy = False
    assert prefiller_takes_local_leg(ctx)  # no healthy decoder: a prefiller answers
    prefill.instances[0].healthy = prefill.instances[1].healthy = False
    assert not prefiller_takes_local_leg(ctx)  # nothing healthy: the decode pool reports it
    prefill.instances[0].healthy = True
    ctx.local_on_prefillers = False
    assert not prefiller_takes_local_leg(ctx)


def test_local_on_prefillers_needs_a_rule_that_sends_legs_local() -> None:
    from kvferry.entrypoints.proxy.config import ProxyConfig
    from kvferry.errors import ConfigError

    with pytest.raises(ConfigError, match="--local-on-prefillers"):
        ProxyConfig(("http://p",), ("http://d",), local_on_prefillers=True)
    ProxyConfig(("http://p",), ("http://d",), local_on_prefillers=True, idle_decoder_prefills=True)


def test_short_prompts_go_whole_to_the_prefiller_while_the_decoder_is_busy(tiny_llama: Path):
    """--local-prefill-tokens 8 --local-on-prefillers: while the decoder answers a short
    prompt, the next short ones (streamed or not) are answered whole by the prefiller: the
    client's request as is, no KV transfer asked; /metrics counts each path."""
    import threading

    with fake_pd(tiny_llama, local_on_prefillers=True) as (prefill, decode, proxy):
        decode.delay = 2.0
        first = threading.Thread(target=ask, args=(proxy, "the cat"))
        first.start()
        deadline = time.monotonic() + 10
        while not decode.requests:  # the decoder holds the first one
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ask(proxy, "a dog")
        ask(proxy, "a bird", stream=True)
        first.join()
        assert [r["prompt"] for r in decode.requests] == ["the cat"]
        assert [r["prompt"] for r in prefill.requests] == ["a dog", "a bird"]
        assert all("kv_transfer_params" not in r and r["max_tokens"] == 3 for r in prefill.requests)
        metrics = plain_http.get(proxy + "/metrics", timeout=10).text
        assert 'kvferry_proxy:prefill_path_total{path="local"} 1.0' in metrics
        assert 'kvferry_proxy:prefill_path_total{path="local_on_prefiller"} 2.0' in metrics
