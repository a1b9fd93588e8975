"""The instance's HTTP edge against hostile input: `kvferry serve` in its own process on a
tiny model, driven over real HTTP. Every class of bad body is a 400/413 with an OpenAI error
body, never a 500, and never fails other clients' requests; a huge prompt is tokenized off
the event loop (/health keeps answering); the model is named, never shown by its path.
(/metrics and /openapi.json needing the API key: tests/test_server_api.py, the same app.)"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import plain_http
from tests.edge_inputs import (
    JSON,
    STARTUP_S,
    Bad,
    bad_beside_good,
    bad_inputs,
    check_bad_head_refused,
    check_log_has_no_crash,
    check_refusal,
    disconnect_lines,
    integer_body,
    leave_mid_body,
    post_while_polling_health,
)
from tests.proxy_fakes import free_port, start_cli, stop, wait_healthy

# slow: `kvferry serve` processes driven with hostile input (make test-all only)
pytestmark = pytest.mark.slow

MAX_BODY = 12_000_000
DEFAULT_MAX_TOKENS = 5


@pytest.fixture(scope="module")
def server_and_log(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("edge") / "serve.log"
    args = ["--log-level", "INFO", "serve", str(tiny_llama), "--port", url.rsplit(":", 1)[1]]
    args += ["--kv-cache-memory", "0.01", "--max-request-body", str(MAX_BODY), "--enforce-eager"]
    args += ["--default-max-tokens", str(DEFAULT_MAX_TOKENS)]
    proc = start_cli(args, log)
    try:
        wait_healthy(proc, url, log, STARTUP_S)
        yield url, log
    finally:
        codes = stop([proc])
    assert codes == [0], log.read_text()[-3000:]


@pytest.fixture(scope="module")
def server(server_and_log: tuple[str, Path]) -> str:
    return server_and_log[0]


def _vocab(model: Path) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]


def test_bad_inputs_are_400_and_others_finish(server: str, tiny_llama: Path) -> None:
    asyncio.run(bad_beside_good(server, {}, bad_inputs(_vocab(tiny_llama))))
    assert plain_http.get(server + "/health").status_code == 200


def test_body_over_the_limit_is_413(server: str) -> None:
    big = b'{"prompt": "' + b"a" * MAX_BODY + b'"}'
    too_large = Bad("too large", "/v1/completions", big, status=413)
    check_refusal(
        plain_http.post(server + "/v1/completions", content=big, headers=JSON, timeout=60), too_large
    )
    chunked = plain_http.post(
        server + "/v1/completions", content=iter([big[:1000], big[1000:]]), headers=JSON
    )
    check_refusal(chunked, too_large)  # no Content-Length: counted while read


def test_a_huge_prompt_does_not_stall_health(server: str) -> None:
    """A prompt of ~8 MB takes seconds to tokenize; /health answers meanwhile."""
    prompt = "The cat sees a small bird, and the dog runs. " * 180_000
    gaps: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server, timeout=30) as http:
            while not done.is_set():
                start = time.monotonic()
                assert http.get("/health").status_code == 200
                gaps.append(time.monotonic() - start)
                time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        start = time.monotonic()
        resp = plain_http.post(
            server + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=120
        )
        took = time.monotonic() - start
    finally:
        done.set()
        poller.join()
    assert resp.status_code == 400 and "maximum context length" in resp.json()["error"]["message"]
    assert took > 1.0, "the prompt was not slow to tokenize: the test proves nothing"
    assert len(gaps) > 5 and max(gaps) < 0.5 * took, (max(gaps), took)


HEALTH_STALL_S = 0.25


def test_a_costly_integer_body_does_not_stall_health(server: str) -> None:
    """4 million token ids in 8 MB, over the JSON value limit: /health answers meanwhile, none
    held for half the request (a body decoded on the event loop would hold one for all of it)
    nor past HEALTH_STALL_S, which a busy 2-core host's scheduling alone stays under."""
    resp, took, health = post_while_polling_health(server, integer_body(4_000_000))
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error", resp.text
    assert took < 30, took
    assert health and max(health) < max(HEALTH_STALL_S, 0.5 * took), (took, health)


def test_a_long_integer_prompt_is_refused_by_its_length_first(server: str) -> None:
    """20,000 token ids whose last is -1: refused for the model's context, by the list's
    length, before the ids are validated one by one (which refuses the list for its negative
    id: "none of the accepted forms")."""
    resp = plain_http.post(server + "/v1/completions", content=integer_body(20_000), headers=JSON, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "prompt", error
    assert "maximum context length" in error["message"] and "20000 tokens" in error["message"], error


def test_a_client_leaving_mid_body_is_one_line(server_and_log: tuple[str, Path]) -> None:
    url, log = server_and_log
    leave_mid_body(url)
    lines = disconnect_lines(log)
    assert len(lines) == 1 and "/v1/completions" in lines[0], lines
    check_log_has_no_crash(log)


def test_bad_request_heads_are_400(server: str) -> None:
    check_bad_head_refused(server)
    assert plain_http.get(server + "/health").status_code == 200


def test_default_max_tokens_caps_a_chat_request_that_sets_none(server: str) -> None:
    """Without the option, max_tokens null generates to the end of the context (vLLM's rule)."""
    messages = [{"role": "user", "content": "Count to a thousand"}]
    for extra in ({"max_tokens": None}, {}):
        body = {"messages": messages, "ignore_eos": True, **extra}
        resp = plain_http.post(server + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS, resp.json()
        assert resp.json()["choices"][0]["finish_reason"] == "length"
    body = {"messages": messages, "ignore_eos": True, "max_tokens": DEFAULT_MAX_TOKENS + 2}
    resp = plain_http.post(server + "/v1/chat/completions", json=body, timeout=120)
    assert resp.json()["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS + 2  # a request's own cap holds


def test_the_model_is_named_not_shown_by_path(server: str, tiny_llama: Path) -> None:
    """Served without --served-model-name: the model's name is its directory's, never its path.
    (The API key guarding /metrics and /openapi.json: tests/test_server_api.py::test_api_key.)"""
    models = plain_http.get(server + "/v1/models")
    body = {"prompt": "hi", "max_tokens": 2}
    answer = plain_http.post(server + "/v1/completions", json=body, timeout=60)
    assert models.json()["data"][0]["id"] == tiny_llama.name == answer.json()["model"]
    for resp in (models, answer):
        assert str(tiny_llama.parent) not in resp.text
    by_path = plain_http.post(server + "/v1/completions", json={**body, "model": str(tiny_llama)}, timeout=60)
    assert by_path.status_code == 200 and by_path.json()["model"] == tiny_llama.name
