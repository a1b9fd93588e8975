"""n > 1 streamed through the P/D proxy, without servers: the per-choice pieces (choice
indices, early text stripped from choice 0 only, each choice's sent tokens and its
continuation request) as units, and the proxy app over HTTP against fake instances whose
decoder streams n answers and can die mid-stream (tests/test_pd_sampling.py and
tests/test_failover.py run the same through real engines)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvferry.entrypoints.proxy.app import build_app
from kvferry.entrypoints.proxy.config import ProxyConfig
from kvferry.entrypoints.proxy.failover import SentChoices
from kvferry.entrypoints.proxy.pd import choice_index
from kvferry.entrypoints.proxy.streaming import early_chunks, strip_sent
from kvferry.sampling_params import INT64_MAX, INT64_MIN, child_seed
from tests import plain_http
from tests.proxy_fakes import FIRST, FakeInstance, serve_in_thread

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# ---- units ------------------------------------------------------------------------------


def test_choice_index_counts_prompt_by_prompt() -> None:
    assert [choice_index(leg, 3, i) for leg in range(2) for i in range(3)] == list(range(6))
    assert choice_index(0, 1, 0) == 0 and choice_index(4, 1, 0) == 4


def test_child_seed_adds_the_index_inside_int64() -> None:
    assert child_seed(77, 0) == 77 and child_seed(77, 2) == 79
    assert child_seed(INT64_MAX, 1) == INT64_MIN and child_seed(INT64_MIN, -1) == INT64_MAX


def _text(index: int, text: str, reason: str | None = None) -> dict:
    return {"choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}]}


def test_strip_sent_drops_the_early_text_from_choice_0_only() -> None:
    out, pending = strip_sent(COMPLETIONS, _text(1, "Hello there"), "Hello")
    assert out is not None and out["choices"][0]["text"] == "Hello there" and pending == "Hello"
    out, pending = strip_sent(COMPLETIONS, _text(0, "Hello there"), pending)
    assert out is not None and out["choices"][0]["text"] == " there" and pending == ""


def test_strip_sent_chat_drops_every_choice_role_and_choice_0_text() -> None:
    role = {"choices": [{"index": 2, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    assert strip_sent(CHAT, role, "Hi")[0] is None  # every choice's role went out early
    other = {"choices": [{"index": 2, "delta": {"content": "Hi"}, "finish_reason": None}]}
    out, pending = strip_sent(CHAT, other, "Hi")
    assert out is not None and out["choices"][0]["delta"] == {"content": "Hi"} and pending == "Hi"


def test_early_chat_chunks_open_every_choice_then_choice_0_text() -> None:
    chunks = early_chunks(CHAT, {"created": 5, "model": "m"}, "Hi", answers=3)
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1, 2, 0]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}] * 3 + [
        {"content": "Hi"}
    ]
    [text] = early_chunks(COMPLETIONS, {"created": 5, "model": "m"}, "Hi", answers=3)
    assert text["choices"][0] == {"index": 0, "text": "Hi", "logprobs": None, "finish_reason": None}


def _ids(index: int, ids: list[int], prompt: list[int] | None = None, reason: str | None = None) -> dict:
    choice = {"index": index, "text": "x", "token_ids": ids, "finish_reason": reason}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    return {"choices": [choice]}


def test_each_choice_resumes_from_its_own_tokens_and_seed() -> None:
    sent = SentChoices(chat=False, answers=3)
    sent.record(_ids(0, [7], prompt=[1, 2]), keep_ids=False)
    sent.record(_ids(1, [8, 9], prompt=[1, 2]), keep_ids=False)
    sent.record(_ids(0, [5], reason="length"), keep_ids=False)
    assert sent.unfinished([0, 1, 2]) == [1, 2]  # choice 0 ended: it is not resumed
    body = {
        "prompt": "a b",
        "n": 3,
        "best_of": 3,
        "seed": 77,
        "max_tokens": 10,
        "kv_transfer_params": {"x": 1},
    }
    one = sent.resume_body(body, 1)
    assert one["prompt"] == [1, 2, 8, 9] and one["resumed_output_tokens"] == 2 and one["max_tokens"] == 8
    assert one["seed"] == 78 and "n" not in one and "best_of" not in one and "kv_transfer_params" not in one
    two = sent.resume_body(body, 2)  # sent nothing yet: the whole request, as answer 2
    assert two == {"prompt": "a b", "seed": 79, "max_tokens": 10, "return_token_ids": True}
    assert "seed" not in sent.resume_body({"prompt": "a b", "n": 3}, 1)  # unseeded stays unseeded


def test_chat_choice_resumes_from_prompt_token_ids() -> None:
    sent = SentChoices(chat=True, answers=2)
    chunk = {
        "choices": [{"index": 1, "delta": {"content": "a"}, "token_ids": [7], "prompt_token_ids": [1, 2]}]
    }
    sent.record(chunk, keep_ids=False)
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_completion_tokens": 5}
    resumed = sent.resume_body(body, 1)
    assert resumed["prompt_token_ids"] == [1, 2, 7] and resumed["max_completion_tokens"] == 4
    assert "n" not in resumed and "prompt" not in resumed


def test_leg_usage_counts_the_prompt_once_and_every_answer() -> None:
    sent = SentChoices(chat=False, answers=3)
    for index in range(3):
        sent.record(_ids(index, [10 + index, 20], prompt=[1, 2, 3]), keep_ids=False)
    sent.record(_ids(0, [30], reason="stop"), keep_ids=False)  # 3 tokens, ended before the loss
    resumed = {}
    for index in (1, 2):
        sent.resume_body({"prompt": "a", "max_tokens": 9}, index)
        usage = {"usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}
        usage["usage"]["prompt_tokens_details"] = {"cached_tokens": 4}
        sent.choices[index].fix_usage(usage)  # the continuation's prompt held the 2 sent tokens
        resumed[index] = usage["usage"]
    assert sent.leg_usage(resumed) == {
        "prompt_tokens": 3,
        "completion_tokens": 3 + 6 + 6,
        "total_tokens": 18,
        "prompt_tokens_details": {"cached_tokens": 3},  # cached of the prompt, not of prompt + sent
    }
    assert sent.leg_usage({}) is None


# ---- the app over HTTP: fake instances ---------------------------------------------------

STEPS = 6  # tokens per answer
SEED = 1000
PROMPT_IDS = [1, 2, 3]


def _piece(answer: int, step: int) -> str:
    """Token ``step`` of answer ``answer``: the prefill's FIRST opens answer 0 (it is handed
    that token), every other one is its own."""
    return FIRST if (answer, step) == (0, 0) else f" {answer}.{step}"


def _answer(answer: int) -> str:
    return "".join(_piece(answer, step) for step in range(STEPS))


class FakeDecoder:
    """Streams n answers a step at a time (n > 1: answer = choice index; n = 1: seed - SEED,
    as the proxy seeds a continuation), from ``resumed_output_tokens``; with ``die_after``,
    its connection breaks after that many answer chunks."""

    def __init__(self, die_after: int | None = None) -> None:
        self.die_after = die_after
        self.requests: list[dict] = []
        self.app = FastAPI()
        self.app.get("/health")(self._health)
        self.app.post(COMPLETIONS)(self._completions)
        self.app.post(CHAT)(self._chat)

    async def _health(self) -> dict:
        return {"status": "ok"}

    async def _completions(self, request: Request) -> Response:
        return self._respond(await request.json(), chat=False)

    async def _chat(self, request: Request) -> Response:
        return self._respond(await request.json(), chat=True)

    def _respond(self, body: dict, chat: bool) -> Response:
        self.requests.append(body)
        if not body.get("stream"):
            return JSONResponse({"error": {"message": "stream only"}}, status_code=400)
        return StreamingResponse(self._stream(body, chat), media_type="text/event-stream")

    async def _stream(self, body: dict, chat: bool) -> AsyncIterator[str]:
        n = body.get("n") or 1
        answers = list(range(n)) if n > 1 else [body["seed"] - SEED if "seed" in body else 0]
        prompt = body.get("prompt_token_ids" if chat else "prompt")
        prompt = prompt if isinstance(prompt, list) else PROMPT_IDS
        start = body.get("resumed_output_tokens", 0)
        if chat:
            for i in range(n):
                yield _sse({"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}]})
        sent = 0
        for step in range(start, STEPS):
            for i, answer in enumerate(answers):
                if sent == self.die_after:
                    raise RuntimeError("the decoder dies")
                chunk = _chunk(chat, i, answer, step, prompt if step == start else None)
                if not body.get("return_token_ids"):
                    chunk["choices"][0].pop("token_ids")
                    chunk["choices"][0].pop("prompt_token_ids", None)
                yield _sse(chunk)
                sent += 1
                await asyncio.sleep(0.005)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n * (STEPS - start)}
            yield _sse({"choices": [], "usage": {**usage, "total_tokens": sum(usage.values())}})
        yield "data: [DONE]\n\n"


def _chunk(chat: bool, index: int, answer: int, step: int, prompt: list[int] | None) -> dict:
    text = _piece(answer, step)
    choice: dict = {"index": index, "finish_reason": "length" if step == STEPS - 1 else None}
    choice |= {"delta": {"content": text}} if chat else {"text": text, "logprobs": None}
    choice["token_ids"] = [100 * answer + step]
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    return {"id": "up", "created": 1, "model": "fake", "choices": [choice]}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@pytest.fixture
def proxy() -> Iterator:
    """proxy(*decoders) -> (URL, the prefill instance): a proxy over one fake prefill
    instance and the given decoders."""
    with ExitStack() as stack:

        def make(*decoders: FakeDecoder) -> tuple[str, FakeInstance]:
            prefill = FakeInstance("prefill0")
            urls = [stack.enter_context(serve_in_thread(d.app)) for d in decoders]
            config = ProxyConfig(
                (stack.enter_context(serve_in_thread(prefill.app)),), tuple(urls), health_interval_s=60.0
            )
            return stack.enter_context(serve_in_thread(build_app(config))), prefill

        yield make


def _stream(url: str, path: str, body: dict) -> list[dict]:
    resp = plain_http.post(url + path, json={**body, "stream": True}, timeout=20)
    assert resp.status_code == 200, resp.text
    return [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]


def _texts(chunks: list[dict]) -> tuple[dict[int, str], dict[int, int]]:
    texts: dict[int, str] = {}
    roles: dict[int, int] = {}
    for chunk in chunks:
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            texts[choice["index"]] = texts.get(choice["index"], "") + (
                choice.get("text") or delta.get("content") or ""
            )
            roles[choice["index"]] = roles.get(choice["index"], 0) + ("role" in delta)
            assert "token_ids" not in choice and "prompt_token_ids" not in choice  # not asked for
    return texts, roles


def _body(path: str, **extra: object) -> dict:
    where = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
    return {**where, "n": 3, "seed": SEED, "temperature": 0.8, "max_tokens": STEPS, **extra}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_n3_stream_sends_choice_0_first_token_early(proxy, path: str) -> None:
    url, _ = proxy(FakeDecoder())
    chunks = _stream(url, path, _body(path))
    texts, roles = _texts(chunks)
    assert texts == {i: _answer(i) for i in range(3)}  # FIRST once, in choice 0
    opening = [
        (c["choices"][0]["index"], c["choices"][0].get("text") or c["choices"][0]["delta"]) for c in chunks
    ]
    if path == CHAT:
        assert roles == {0: 1, 1: 1, 2: 1}
        assert opening[3] == (0, {"content": FIRST})  # right after the three roles
    else:
        assert opening[0] == (0, FIRST)
    metrics = plain_http.get(url + "/metrics").text
    assert "kvferry_proxy:early_first_tokens_total 1.0" in metrics


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_n3_stream_continues_every_unfinished_choice_when_its_decoder_dies(proxy, path: str) -> None:
    """The decoder dies after 8 answer chunks (choices 0 and 1 have 3 tokens, choice 2 has
    2): each choice continues on the other decoder as its own n = 1 request (its prompt and
    sent ids, its seed), re-indexed; the texts and the usage are the undisturbed ones."""
    dying, survivor = FakeDecoder(die_after=8), FakeDecoder()
    url, prefill = proxy(dying, survivor)
    chunks = _stream(url, path, _body(path, stream_options={"include_usage": True}))
    texts, roles = _texts(chunks)
    assert texts == {i: _answer(i) for i in range(3)}
    assert roles == ({0: 1, 1: 1, 2: 1} if path == CHAT else {0: 0, 1: 0, 2: 0})
    continued = sorted(survivor.requests, key=lambda b: b["seed"])
    assert [(b["seed"], b["resumed_output_tokens"]) for b in continued] == [
        (SEED, 3),
        (SEED + 1, 3),
        (SEED + 2, 2),
    ]
    prompt_field = "prompt_token_ids" if path == CHAT else "prompt"
    assert continued[2][prompt_field] == PROMPT_IDS + [200, 201]
    assert all("n" not in b and "kv_transfer_params" not in b for b in continued)
    usages = [c["usage"] for c in chunks if c.get("usage")]
    assert usages == [{"prompt_tokens": 3, "completion_tokens": 3 * STEPS, "total_tokens": 3 + 3 * STEPS}]
    deadline = time.monotonic() + 5
    while prefill.released != ["prefill0-0"]:  # the lost decoder's KV lease, given back
        assert time.monotonic() < deadline, prefill.released
        time.sleep(0.01)
    metrics = plain_http.get(url + "/metrics").text
    assert 'kvferry_proxy:decode_failovers_total{mode="stream"} 1.0' in metrics


def test_n3_batch_stream_indexes_each_prompt_choices(proxy) -> None:
    url, _ = proxy(FakeDecoder())
    texts, _ = _texts(_stream(url, COMPLETIONS, _body(COMPLETIONS, prompt=["a", "b"])))
    assert texts == {leg * 3 + i: _answer(i) for leg in range(2) for i in range(3)}
