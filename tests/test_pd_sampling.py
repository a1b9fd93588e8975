"""Sampling constraints and n > 1 through `kvferry disagg` (NIXL P/D and the proxy): the
prefiller honours min_tokens, logit_bias, allowed_token_ids and bad_words for the first
token it samples, the decoder continues under them, and every greedy answer is
byte-identical to a colocated engine's; n = 3 prefills the prompt once."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvferry.engine.llm import LLM
from kvferry.entrypoints.openai.serving_completions import prompt_logprobs_json
from kvferry.sampling_params import SamplingParams
from tests import plain_http
from tests.proxy_fakes import free_port, start_cli
from tests.test_disagg import MODEL, Deployment, _disagg_args, _metric, _wait_blocks_free

pytestmark = pytest.mark.slow  # a `kvferry disagg` deployment (make test-all)

PROMPT = " ".join(["the old man reads a golden book by the sea"] * 3)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def deployment(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("pd_sampling")
    log = tmp / "disagg.log"
    proc = start_cli(_disagg_args(tiny_llama, free_port(), tmp / "logs"), log)
    try:
        yield Deployment(proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def colocated(tiny_llama: Path, deployment: Deployment) -> LLM:
    """The colocated reference engine (built while the deployment starts)."""
    return LLM(str(tiny_llama), kv_cache_bytes=5 << 20, enforce_eager=True)


def _first_token(llm: LLM) -> int:
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0]
    return free.token_ids[0]


def _cases(llm: LLM, first: int) -> list[dict]:
    """Request extras, each changing the first token of the unconstrained greedy answer."""
    word = llm.get_tokenizer().decode([first]).strip()
    return [
        {"min_tokens": 6, "stop_token_ids": [first]},
        {"logit_bias": {str(first): -100, "5": 0.5}},
        {"allowed_token_ids": [5, 9, 17, 30]},
        {"bad_words": [word], "min_tokens": MAX_TOKENS},
    ]


def _params(extra: dict) -> SamplingParams:
    kw = dict(extra)
    if "logit_bias" in kw:
        kw["logit_bias"] = {int(k): float(v) for k, v in kw["logit_bias"].items()}
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kw)


def test_pd_answers_under_each_constraint_equal_colocated(colocated: LLM, deployment: Deployment) -> None:
    llm = colocated
    first = _first_token(llm)
    cases = _cases(llm, first)
    proxy, prefill, decode = deployment.ready()
    with httpx.Client(base_url=proxy, timeout=60) as http:
        for extra in cases:
            want = llm.generate(PROMPT, _params(extra))[0].outputs[0]
            assert want.token_ids[0] != first, extra  # the prefiller's token is constrained
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
            got = http.post("/v1/completions", json={**body, "return_token_ids": True}).json()["choices"][0]
            assert (got["token_ids"], got["text"]) == (want.token_ids, want.text), extra
            streamed = http.post("/v1/completions", json={**body, "stream": True}).text
            chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
            assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == want.text, extra
    _wait_blocks_free(prefill)
    _wait_blocks_free(decode)


def test_pd_n3_transfers_the_prompt_once(colocated: LLM, deployment: Deployment) -> None:
    llm = colocated
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0].text
    proxy, prefill, decode = deployment.ready()
    prompt_len = len(llm.get_tokenizer().encode(PROMPT))
    before = (
        _metric(prefill, "kvferry:prompt_tokens_total"),
        _metric(decode, "kvferry:prefix_cache_hits_total"),
    )
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "n": 3}
    resp = plain_http.post(proxy + "/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert [c["text"] for c in resp["choices"]] == [want] * 3
    assert _metric(prefill, "kvferry:prompt_tokens_total") - before[0] == prompt_len  # one prefill
    assert _metric(decode, "kvferry:prefix_cache_hits_total") - before[1] >= 2 * (prompt_len // 16 * 16 - 16)
    _wait_blocks_free(prefill)
    _wait_blocks_free(decode)


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def _colocated_prompt_logprobs(llm: LLM, prompt: str | list[int], k: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    plp = llm.generate(prompt, params)[0].prompt_logprobs
    assert plp is not None
    return json.loads(json.dumps(prompt_logprobs_json(plp)))


def _hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return [logprobs[i - 1, prompt[i]].item() for i in range(1, len(prompt))]


def test_pd_prompt_logprobs_are_the_prefillers_and_equal_colocated(
    tiny_llama: Path, colocated: LLM, deployment: Deployment
) -> None:
    """The decoder handed the KV never computes the prompt: the prefiller's prompt_logprobs
    reach the client, identical to a colocated engine's (and to HF's log-softmax), in every
    choice of a completion, streamed or not, and in chat (top level)."""
    proxy, prefill, decode = deployment.ready()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 2, "n": 2}
    with httpx.Client(base_url=proxy, timeout=60) as http:
        whole = http.post("/v1/completions", json={**body, "return_token_ids": True}).json()
        prompt_ids = whole["choices"][0]["prompt_token_ids"]
        want = _colocated_prompt_logprobs(colocated, prompt_ids, 2)
        assert [c["prompt_logprobs"] for c in whole["choices"]] == [want, want]
        hf = _hf_prompt_logprobs(tiny_llama, prompt_ids)
        got = [entry[str(token)]["logprob"] for entry, token in zip(want[1:], prompt_ids[1:])]
        assert max(abs(a - b) for a, b in zip(got, hf)) < 1e-4
        chunks = _events(http.post("/v1/completions", json={**body, "stream": True}).text)
        firsts: dict[int, object] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                firsts.setdefault(choice["index"], choice.get("prompt_logprobs"))
        assert firsts == {0: want, 1: want}  # each choice's first chunk carries them
        sent = [c.get("prompt_logprobs") for chunk in chunks for c in chunk["choices"]]
        assert sum(plp is not None for plp in sent) == 2
        chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
        chat |= {"temperature": 0, "prompt_logprobs": 1}
        answer = http.post("/v1/chat/completions", json={**chat, "return_token_ids": True}).json()
        chat_want = _colocated_prompt_logprobs(colocated, answer["choices"][0]["prompt_token_ids"], 1)
        assert answer["prompt_logprobs"] == chat_want
        chat_chunks = _events(http.post("/v1/chat/completions", json={**chat, "stream": True}).text)
        assert chat_chunks[0]["prompt_logprobs"] == chat_want
        assert all("prompt_logprobs" not in c for c in chat_chunks[1:])
    _wait_blocks_free(prefill)
    _wait_blocks_free(decode)


def test_pd_n3_streamed_equals_colocated_and_prefills_once(colocated: LLM, deployment: Deployment) -> None:
    """Streamed n = 3 through P/D: every choice equals the colocated greedy answer, and the
    prompt is prefilled once (the decoder's siblings hit the KV received for the first)."""
    want = colocated.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0].text
    proxy, prefill, decode = deployment.ready()
    prompt_len = len(colocated.get_tokenizer().encode(PROMPT))
    before = _metric(prefill, "kvferry:prompt_tokens_total")
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "n": 3,
        "stream": True,
    }
    texts: dict[int, str] = {}
    for chunk in _events(plain_http.post(proxy + "/v1/completions", json=body, timeout=60).text):
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: want, 1: want, 2: want}
    assert _metric(prefill, "kvferry:prompt_tokens_total") - before == prompt_len  # one prefill
    _wait_blocks_free(prefill)
    _wait_blocks_free(decode)


MESSAGES = [{"role": "user", "content": PROMPT}]
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 77}
EARLY = "kvferry_proxy:early_first_tokens_total"


def _by_choice(chunks: list[dict]) -> tuple[dict[int, str], dict[int, int]]:
    """Each choice's text (completion text or chat content, concatenated) and, for chat, how
    many role chunks it had."""
    texts: dict[int, str] = {}
    roles: dict[int, int] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            index = choice["index"]
            delta = choice.get("delta") or {}
            texts[index] = texts.get(index, "") + (choice.get("text") or delta.get("content") or "")
            roles[index] = roles.get(index, 0) + ("role" in delta)
    return texts, roles


def _streamed(url: str, path: str, body: dict) -> list[dict]:
    resp = plain_http.post(url + path, json={**body, "stream": True}, timeout=60)
    assert resp.status_code == 200, resp.text
    return _events(resp.text)


def _n3_body(path: str, sampling: dict, prompt: str | list[str] = PROMPT) -> dict:
    where = {"messages": MESSAGES} if path == "/v1/chat/completions" else {"prompt": prompt}
    return {"model": MODEL, **where, "max_tokens": MAX_TOKENS, "n": 3, **sampling}


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"], ids=["completion", "chat"])
def test_pd_n3_stream_sends_choice_0_early_and_equals_colocated(
    deployment: Deployment, path: str, sampling: dict
) -> None:
    """n = 3 streamed through the proxy: choice 0's first token goes out as soon as the
    prefill answers (the proxy's early_first_tokens counter), and every choice's text, role
    chunk and usage equal a colocated server's stream (the decode instance asked directly:
    it computes the prompt itself)."""
    proxy, prefill, decode = deployment.ready()
    body = {**_n3_body(path, sampling), "stream_options": {"include_usage": True}}
    colocated = _streamed(decode, path, body)
    early = _metric(proxy, EARLY)
    pd = _streamed(proxy, path, body)
    assert _metric(proxy, EARLY) == early + 1  # the early path was taken
    want, want_roles = _by_choice(colocated)
    got, got_roles = _by_choice(pd)
    assert got == want and sorted(got) == [0, 1, 2]
    assert got_roles == want_roles
    if path == "/v1/chat/completions":
        assert got_roles == {0: 1, 1: 1, 2: 1}
        assert [c["choices"][0]["index"] for c in pd[:3]] == [0, 1, 2]  # the roles open the stream
    if sampling is SEEDED:
        assert len(set(got.values())) > 1  # each choice has its own seed
    first_text = next(c for c in pd if _by_choice([c])[0].get(0))
    assert first_text["choices"][0]["index"] == 0
    usage = [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) for c in pd if c.get("usage")]
    assert usage == [
        (c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) for c in colocated if c.get("usage")
    ]
    _wait_blocks_free(prefill)
    _wait_blocks_free(decode)


def test_pd_n3_batch_stream_indexes_choices_prompt_by_prompt(deployment: Deployment) -> None:
    """A completions batch of two prompts with n = 3, seeded: choice index = prompt * n + i,
    each text as a colocated server streams it."""
    proxy, prefill, decode = deployment.ready()
    prompts = [PROMPT, "a small bird sings in the old tree"]
    body = _n3_body("/v1/completions", SEEDED, prompts)
    early = _metric(proxy, EARLY)
    got, _ = _by_choice(_streamed(proxy, "/v1/completions", body))
    assert _metric(proxy, EARLY) == early + 2  # each prompt's leg
    want, _ = _by_choice(_streamed(decode, "/v1/completions", body))
    assert got == want and sorted(got) == list(range(6))
    _wait_blocks_free(prefill)
    _wait_blocks_free(decode)
