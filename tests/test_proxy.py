"""The P/D proxy: selection policies, request shaping, stream stitching (units), and the
proxy app over real HTTP against fake instances (health, retries, errors, routing)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import openai
import pytest

from kvferry.entrypoints.proxy.app import build_app
from kvferry.entrypoints.proxy.config import ProxyConfig
from kvferry.entrypoints.proxy.errors import NoHealthyInstanceError, UpstreamUnavailableError
from kvferry.entrypoints.proxy.metrics import ProxyMetrics
from kvferry.entrypoints.proxy.pd import (
    decode_body,
    decoder_repeats_first_token,
    merge_answers,
    prefill_body,
    prefill_prompt_logprobs,
    split_legs,
    stop_may_cut,
    with_prompt_logprobs,
)
from kvferry.entrypoints.proxy.pool import InstancePool, LeastLoaded, RoundRobin
from kvferry.entrypoints.proxy.streaming import strip_sent
from kvferry.entrypoints.proxy.upstream import Upstream
from tests import plain_http
from tests.proxy_fakes import ANSWER, ANSWER_CHUNKS, FIRST, FakeInstance, free_port, serve_in_thread

# ---- units ------------------------------------------------------------------------------


def _pool(policy, n: int = 3) -> InstancePool:
    return InstancePool("decode", [f"http://h{i}" for i in range(n)], policy)


def test_round_robin_cycles_and_skips_unhealthy() -> None:
    pool = _pool(RoundRobin())
    picks = [pool.acquire().url for _ in range(4)]
    assert picks == ["http://h0", "http://h1", "http://h2", "http://h0"]
    pool.mark(pool.instances[1], False, "down")
    assert [pool.acquire().url for _ in range(3)] == ["http://h2", "http://h0", "http://h2"]
    pool.mark(pool.instances[1], True)
    assert pool.acquire().url == "http://h0" and pool.acquire().url == "http://h1"


def test_least_loaded_prefers_fewest_in_flight_and_rotates_ties() -> None:
    pool = _pool(LeastLoaded())
    a = pool.acquire()
    b = pool.acquire()
    c = pool.acquire()
    assert [a.url, b.url, c.url] == ["http://h0", "http://h1", "http://h2"]  # ties rotate
    pool.release(b)
    assert pool.acquire() is b  # the only one with 0 in flight
    pool.release(a)
    pool.release(c)
    pool.acquire()  # a or c, both at 0
    busy = {i.url: i.in_flight for i in pool.instances}
    assert sorted(busy.values()) == [0, 1, 1]
    pool.mark(pool.instances[0], False)
    pool.mark(pool.instances[2], False)
    assert pool.acquire() is b  # the only healthy one, however loaded


def test_no_healthy_instance_is_503_with_reasons() -> None:
    pool = _pool(RoundRobin(), n=2)
    for inst in pool.instances:
        pool.mark(inst, False, "ConnectError")
    with pytest.raises(NoHealthyInstanceError) as err:
        pool.acquire()
    assert err.value.status_code == 503
    assert "no healthy decode instance" in err.value.message and "ConnectError" in err.value.message


def test_prefill_and_decode_bodies() -> None:
    body = {"messages": [], "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}}
    pre = prefill_body("/v1/chat/completions", body)
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1 and pre["stream"] is False
    assert pre["kv_transfer_params"] == {"do_remote_decode": True} and "stream_options" not in pre
    assert body["max_tokens"] == 9 and "kv_transfer_params" not in body  # the original is untouched
    params = {"engine_id": "p0", "block_ids": [[1, 2]], "first_token_id": 5}
    dec = decode_body(body, {"choices": [], "kv_transfer_params": params})
    assert dec == {**body, "kv_transfer_params": params}
    assert "kv_transfer_params" not in decode_body(body, {"choices": []})  # no connector: recompute


def test_prefill_body_keeps_first_token_constraints_and_drops_n() -> None:
    body = {"prompt": "a", "max_tokens": 9, "n": 3, "best_of": 4, "min_tokens": 5, "logit_bias": {"7": -100}}
    body |= {"allowed_token_ids": [1, 2], "bad_words": ["x"]}
    pre = prefill_body("/v1/completions", body)
    assert "n" not in pre and "best_of" not in pre and pre["min_tokens"] == 1
    assert (pre["logit_bias"], pre["allowed_token_ids"], pre["bad_words"]) == ({"7": -100}, [1, 2], ["x"])
    answers = [{"choices": [{"index": i, "text": f"{p}{i}"} for i in range(2)]} for p in "ab"]
    assert [(c["index"], c["text"]) for c in merge_answers(answers)["choices"]] == [
        (0, "a0"),
        (1, "a1"),
        (2, "b0"),
        (3, "b1"),
    ]


def test_prompt_logprobs_come_from_the_prefiller_when_it_hands_over_the_kv() -> None:
    """The decoder handed the KV does not compute the prompt: it is not asked for its
    logprobs; the prefiller's go into every choice (chat: the response)."""
    body = {"prompt": "a b", "max_tokens": 9, "n": 2, "prompt_logprobs": 1}
    plp = [None, {"7": {"logprob": -1.5, "rank": 2, "decoded_token": " b"}}]
    assert prefill_body("/v1/completions", body)["prompt_logprobs"] == 1
    kept = {"choices": [{"index": 0, "text": "x", "prompt_logprobs": plp}], "kv_transfer_params": {"x": 1}}
    assert "prompt_logprobs" not in decode_body(body, kept)
    assert prefill_prompt_logprobs("/v1/completions", body, kept) == plp
    answer = {"choices": [{"index": 0, "text": "u"}, {"index": 1, "text": "v"}]}
    spliced = with_prompt_logprobs("/v1/completions", answer, plp)
    assert [c["prompt_logprobs"] for c in spliced["choices"]] == [plp, plp]
    assert with_prompt_logprobs("/v1/chat/completions", answer, plp)["prompt_logprobs"] == plp
    recompute = {"choices": [{"index": 0, "text": "x", "prompt_logprobs": plp}]}  # no connector
    assert decode_body(body, recompute)["prompt_logprobs"] == 1  # the decoder computes them
    assert prefill_prompt_logprobs("/v1/completions", body, recompute) is None
    assert prefill_prompt_logprobs("/v1/completions", {**body, "prompt_logprobs": None}, kept) is None


def test_batches_split_into_legs_and_merge_back() -> None:
    body = {"prompt": ["a", [1, 2]], "max_tokens": 3}
    assert split_legs("/v1/completions", body) == [
        {"prompt": "a", "max_tokens": 3},
        {"prompt": [1, 2], "max_tokens": 3},
    ]
    assert split_legs("/v1/completions", {"prompt": [1, 2]}) == [{"prompt": [1, 2]}]
    usage = {
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    answers = [{"id": f"c{i}", "choices": [{"index": 0, "text": f"t{i}"}], "usage": usage} for i in range(2)]
    merged = merge_answers(answers)
    assert [c["index"] for c in merged["choices"]] == [0, 1] and merged["choices"][1]["text"] == "t1"
    assert merged["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 6,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_early_first_token_needs_a_decoder_that_repeats_it() -> None:
    handed = {"choices": [], "kv_transfer_params": {"first_token_id": 5}}
    assert decoder_repeats_first_token({"temperature": 0.8, "seed": 1}, handed)
    assert decoder_repeats_first_token({}, handed)  # sampled, unseeded: the decoder outputs it too
    assert decoder_repeats_first_token({"temperature": 0}, {"choices": []})  # no connector: greedy
    assert not decoder_repeats_first_token({"temperature": 0.8}, {"choices": []})
    given_kv_only = {"choices": [], "kv_transfer_params": {"remote_block_ids": [1], "remote_engine_id": "p"}}
    assert not decoder_repeats_first_token({"temperature": 0}, given_kv_only)  # vLLM: samples again
    bad = {"choices": [], "kv_transfer_params": {"first_token_id": True}}
    assert not decoder_repeats_first_token({}, bad)


def test_stop_may_cut_the_first_token() -> None:
    assert not stop_may_cut("Hello", None) and not stop_may_cut("Hello", [])
    assert stop_may_cut("Hello", "ll") and stop_may_cut("Hello", ["x", "lo w"])  # within; begins
    assert not stop_may_cut("Hello", ["world", "xy"]) and stop_may_cut("Hello", ["oh"])
    assert stop_may_cut("Hello", "Hello") and stop_may_cut("Hello", ["Hel"])


def _text_chunk(text: str, reason: str | None = None) -> dict:
    return {"id": "d", "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}


def test_strip_sent_drops_the_early_text_across_chunks() -> None:
    pending = "Hello"
    out, pending = strip_sent("/v1/completions", _text_chunk("Hel"), pending)
    assert out is None and pending == "lo"
    out, pending = strip_sent("/v1/completions", _text_chunk("lo world"), pending)
    assert out["choices"][0]["text"] == " world" and pending == ""
    out, _ = strip_sent("/v1/completions", _text_chunk("", "length"), pending)
    assert out["choices"][0]["finish_reason"] == "length"  # a finish with no text still goes out
    usage = {"id": "d", "choices": [], "usage": {"total_tokens": 3}}
    assert strip_sent("/v1/completions", usage, "")[0] == usage


def test_strip_sent_keeps_the_token_ids_of_the_early_text() -> None:
    """The early text carried no ids: the decoder's chunk for it keeps them (text dropped)."""
    chunk = _text_chunk("Hello")
    chunk["choices"][0].update(token_ids=[9], prompt_token_ids=[1, 2])
    out, pending = strip_sent("/v1/completions", chunk, "Hello")
    assert pending == "" and out["choices"][0]["text"] == ""
    assert out["choices"][0]["token_ids"] == [9] and out["choices"][0]["prompt_token_ids"] == [1, 2]


def test_strip_sent_chat_drops_the_role_chunk() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    assert strip_sent("/v1/chat/completions", role, "Hi")[0] is None
    first = {"choices": [{"index": 0, "delta": {"content": "Hi there"}, "finish_reason": None}]}
    out, pending = strip_sent("/v1/chat/completions", first, "Hi")
    assert out["choices"][0]["delta"] == {"content": " there"} and pending == ""


# ---- the app over HTTP, against fake instances -------------------------------------------


class Deployment:
    def __init__(self, url: str, prefill: list[FakeInstance], decode: list[FakeInstance]) -> None:
        self.url = url
        self.prefill = prefill
        self.decode = decode


@pytest.fixture
def deploy() -> Iterator:
    """deploy(n_prefill, n_decode, dead_prefill=0, dead_decode=0, **config) -> Deployment."""
    with ExitStack() as stack:

        def make(n_prefill: int = 1, n_decode: int = 1, dead_prefill: int = 0, dead_decode: int = 0, **kw):
            fakes = {"prefill": [], "decode": []}
            urls = {"prefill": [], "decode": []}
            for role, n, dead in (("prefill", n_prefill, dead_prefill), ("decode", n_decode, dead_decode)):
                urls[role] += [f"http://127.0.0.1:{free_port()}" for _ in range(dead)]  # nothing listens
                for i in range(n):
                    fake = FakeInstance(f"{role}{i}")
                    fakes[role].append(fake)
                    urls[role].append(stack.enter_context(serve_in_thread(fake.app)))
            kw.setdefault("health_interval_s", 60.0)
            config = ProxyConfig(tuple(urls["prefill"]), tuple(urls["decode"]), **kw)
            url = stack.enter_context(serve_in_thread(build_app(config)))
            return Deployment(url, fakes["prefill"], fakes["decode"])

        yield make


def test_each_request_is_prefilled_then_decoded_round_robin(deploy) -> None:
    d = deploy(2, 2)
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0)
    for _ in range(4):
        resp = client.completions.create(model="fake", prompt="hi", max_tokens=5)
        assert resp.choices[0].text == ANSWER and resp.usage.completion_tokens == len(ANSWER_CHUNKS)
    assert [len(f.requests) for f in d.prefill + d.decode] == [2, 2, 2, 2]
    pre, dec = d.prefill[0].requests[0], d.decode[0].requests[0]
    assert pre["max_tokens"] == 1 and pre["stream"] is False
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert dec["max_tokens"] == 5 and dec["kv_transfer_params"] == {
        "engine_id": "prefill0",
        "first_token_id": 7,
        "remote_request_id": "prefill0-0",
    }


def test_stream_sends_the_prefill_token_first_and_once(deploy) -> None:
    # (which requests go early, sampled ones included: test_which_streams_send_the_prefill_token_early)
    d = deploy()
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0)
    chunks = list(
        client.completions.create(model="fake", prompt="hi", max_tokens=5, temperature=0, stream=True)
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == FIRST and "".join(texts) == ANSWER
    assert len({c.id for c in chunks}) == 1
    stream = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == FIRST
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    assert chunks[-1].usage.total_tokens == 6


def test_refused_connection_goes_to_the_next_instance(deploy) -> None:
    d = deploy(1, 1, dead_prefill=1)
    for _ in range(2):
        resp = plain_http.post(d.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == ANSWER
    health = plain_http.get(d.url + "/health").json()["instances"]["prefill"]
    assert [i["healthy"] for i in health] == [False, True] and "ConnectError" in health[0]["error"]


def test_dead_decoder_is_503_with_its_reason(deploy) -> None:
    d = deploy(1, 0, dead_decode=1)
    for body in ({"prompt": "hi"}, {"prompt": "hi", "stream": True}):
        resp = plain_http.post(d.url + "/v1/completions", json=body, timeout=10)
        assert resp.status_code == 503  # the first health check (at start) found it dead
        message = resp.json()["error"]["message"]
        assert message.startswith("no healthy decode instance") and "ConnectError" in message
    assert plain_http.get(d.url + "/health").status_code == 503


def test_refused_everywhere_is_502() -> None:
    """Instances still marked healthy that refuse connections: each is tried once, then 502."""
    pool = InstancePool("decode", [f"http://127.0.0.1:{free_port()}" for _ in range(2)], RoundRobin())

    async def go() -> None:
        async with httpx.AsyncClient() as client:
            upstream = Upstream(client, ProxyMetrics([pool]))
            await upstream.post_json(pool, "/v1/completions", {"prompt": "hi"}, {})

    with pytest.raises(UpstreamUnavailableError) as err:
        asyncio.run(go())
    assert err.value.status_code == 502
    assert err.value.message.startswith("could not connect to any decode instance (tried http://127.0.0.1:")
    assert pool.num_healthy == 0 and all(i.in_flight == 0 for i in pool.instances)


def test_health_checks_take_instances_out_and_back(deploy) -> None:
    d = deploy(1, 2, health_interval_s=0.05)
    d.decode[0].health = 503
    _wait(lambda: not plain_http.get(d.url + "/health").json()["instances"]["decode"][0]["healthy"])
    for _ in range(3):
        plain_http.post(d.url + "/v1/completions", json={"prompt": "hi"}, timeout=10).raise_for_status()
    assert len(d.decode[0].requests) == 0 and len(d.decode[1].requests) == 3
    d.decode[1].health = 500
    _wait(lambda: plain_http.get(d.url + "/health").status_code == 503)
    assert plain_http.post(d.url + "/v1/completions", json={"prompt": "hi"}, timeout=10).status_code == 503
    d.decode[0].health = 200
    _wait(lambda: plain_http.get(d.url + "/health").status_code == 200)
    plain_http.post(d.url + "/v1/completions", json={"prompt": "hi"}, timeout=10).raise_for_status()
    assert len(d.decode[0].requests) == 1


def test_least_loaded_sends_to_the_idle_decoder(deploy) -> None:
    d = deploy(1, 2, policy="least_loaded")
    d.decode[0].delay = 0.6

    async def go() -> None:
        async with httpx.AsyncClient(base_url=d.url, timeout=10) as http:
            slow = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "slow"}))
            await asyncio.sleep(0.2)  # the slow one is in flight on decode0
            for _ in range(3):
                (await http.post("/v1/completions", json={"prompt": "fast"})).raise_for_status()
            (await slow).raise_for_status()

    asyncio.run(go())
    assert [r["prompt"] for r in d.decode[0].requests] == ["slow"]
    assert [r["prompt"] for r in d.decode[1].requests] == ["fast"] * 3


def test_upstream_error_keeps_status_and_body(deploy) -> None:
    d = deploy()
    d.decode[0].fail_status = 400
    resp = plain_http.post(d.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert resp.status_code == 400
    assert resp.json() == {
        "error": {
            "message": "decode0 refuses",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": None,
        }
    }
    # Once the first token is out (early, in a stream), a decoder error arrives in-stream.
    body = {"prompt": "hi", "stream": True, "temperature": 0}
    with plain_http.stream("POST", d.url + "/v1/completions", json=body, timeout=10) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert resp.status_code == 200
    assert json.loads(lines[0][6:])["choices"][0]["text"] == FIRST
    assert json.loads(lines[1][6:])["error"]["message"] == "decode0 refuses" and lines[2] == "data: [DONE]"
    d.prefill[0].fail_status = 404
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    resp = plain_http.post(d.url + "/v1/chat/completions", json=chat, timeout=10)
    assert resp.status_code == 404 and resp.json()["error"]["message"] == "prefill0 refuses"


@pytest.mark.parametrize(
    ("extra", "early"),
    [
        ({"temperature": 0.8, "seed": 3}, True),
        ({}, True),
        ({"logprobs": 1}, False),  # the decoder's logprobs, first token included
        ({"stop": ["lo w"]}, False),  # the answer may stop inside "Hello"
        ({"stop": "zzz"}, True),
    ],
)
def test_which_streams_send_the_prefill_token_early(deploy, extra: dict, early: bool) -> None:
    """Seen through a failing decoder: after an early token its error comes in-stream."""
    d = deploy()
    d.decode[0].fail_status = 400
    body = {"prompt": "hi", "stream": True, **extra}
    with plain_http.stream("POST", d.url + "/v1/completions", json=body, timeout=10) as resp:
        lines = [line for line in resp.iter_lines() if line]
    if not early:
        assert resp.status_code == 400
        return
    assert resp.status_code == 200 and json.loads(lines[0][6:])["choices"][0]["text"] == FIRST
    assert json.loads(lines[1][6:])["error"]["message"] == "decode0 refuses"


def test_api_key_models_and_metrics(deploy) -> None:
    d = deploy(api_key="sk-proxy")
    assert plain_http.post(d.url + "/v1/completions", json={"prompt": "hi"}).status_code == 401
    auth = {"Authorization": "Bearer sk-proxy"}
    assert plain_http.post(d.url + "/v1/completions", json={"prompt": "hi"}, headers=auth).status_code == 200
    assert d.decode[0].requests  # the key was checked here, and the request went on
    assert plain_http.get(d.url + "/v1/models", headers=auth).json()["data"][0]["owned_by"] == "decode0"
    bad = plain_http.post(d.url + "/v1/completions", content=b"{nope", headers=auth)
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    assert plain_http.get(d.url + "/metrics").status_code == 401  # the key guards it too
    metrics = plain_http.get(d.url + "/metrics", headers=auth).text
    assert 'kvferry_proxy:requests_total{endpoint="/v1/completions",status="200"} 1.0' in metrics
    assert "kvferry_proxy:instance_healthy" in metrics


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_leg_without_a_decoder_answer_releases_the_prefill(deploy) -> None:
    """The client leaves (or the decoder fails) after the prefill answered: the proxy asks
    that prefill instance to free the KV it keeps for the leg; a decoded leg releases nothing."""
    d = deploy(2, 1)
    prefill = {f.name: f for f in d.prefill}
    assert plain_http.post(d.url + "/v1/completions", json={"prompt": "hi"}, timeout=10).status_code == 200
    d.decode[0].delay = 3.0
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the decoder works
        plain_http.post(d.url + "/v1/completions", json={"prompt": "hi"}, timeout=1.0)
    _wait(lambda: prefill["prefill1"].released == ["prefill1-0"])
    body = {"prompt": "hi", "stream": True, "temperature": 0}
    with plain_http.stream("POST", d.url + "/v1/completions", json=body, timeout=10) as resp:
        first = next(line for line in resp.iter_lines() if line)  # the early token, then leave
    assert json.loads(first[6:])["choices"][0]["text"] == FIRST
    _wait(lambda: prefill["prefill0"].released == ["prefill0-1"])
    d.decode[0].delay = 0.0
    d.decode[0].fail_status = 400
    for stream in (False, True):
        plain_http.post(d.url + "/v1/completions", json={**body, "stream": stream}, timeout=10)
    _wait(lambda: prefill["prefill1"].released == ["prefill1-0", "prefill1-1"])
    _wait(lambda: prefill["prefill0"].released == ["prefill0-1", "prefill0-2"])
    assert prefill["prefill0"].requests[0]["kv_transfer_params"] == {"do_remote_decode": True}
