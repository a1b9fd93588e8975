"""Streamed tool calls across a decoder failover, in real processes: `kvferry disagg` with
1 prefiller and 2 decoders (NIXL) on the tiny llama. A chat answer that calls a tool
(`tool_choice` `required`; the function named, with the proxy's early first token as the
call's announcement and without it; `auto`, the call in the template's markup) is streamed
through the proxy and the decoder writing it is SIGKILLed mid-call; the other decoder
continues it, its tool-call parser primed with the answer so far (openai/answer_calls.py).
The openai client's accumulation of the stream equals a colocated server's (a decoder
asked directly): one call, announced once (its id never doubled), whose arguments parse
and validate against the tool's schema; one failover is counted and the surviving
instances end with every KV block free. The launcher restarts the killed decoder before
the next case."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from tests import plain_http
from tests.test_disagg_restart import (
    Deployment,
    _decoder_health,
    _kill_group,
    _metric,
    _wait,
    _wait_ready,
    disagg_launched,
)
from tests.test_failover import digits_schema

# slow: three `kvferry serve` processes and a proxy, a decoder killed and restarted (make test-all only)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL = "tiny"
# 60 digits (about 120 tokens of compact JSON): the kill lands inside the call's arguments.
SCHEMA = digits_schema(60)
TOOL = {
    "type": "function",
    "function": {"name": "record", "description": "Record digits", "parameters": SCHEMA},
}
REQUEST = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Record sixty digits."}],
    "tools": [TOOL],
    "parallel_tool_calls": False,
    "max_tokens": 400,
    "temperature": 0,
    "stream": True,
}
CALLS_BEFORE_KILL = 12  # chunks with tool_calls the client has when the decoder is killed


@pytest.fixture(scope="module")
def deployment(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """`kvferry disagg` 1P+2D, ready; a decoder may be restarted once per case."""
    tmp = tmp_path_factory.mktemp("failover-tools")
    with disagg_launched(tiny_llama, tmp, MODEL, len(CASES)) as (proc, log):
        proxy, prefill, decode = _wait_ready(proc, log).groups()
        yield Deployment(proc, log, proxy, prefill, decode.split())


class Streamer:
    """One streamed chat request in a thread: its chunks, as they come."""

    def __init__(self, url: str, body: dict) -> None:
        self.url, self.body = url + "/v1/chat/completions", body
        self.chunks: list[dict] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def calls_chunks(self) -> int:
        return sum(1 for c in self.chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls"))

    def result(self, timeout: float = 300) -> list[dict]:
        assert self.done.wait(timeout), "no answer in time"
        if self.error is not None:
            raise self.error
        return self.chunks

    def _run(self) -> None:
        try:
            with plain_http.stream("POST", self.url, json=self.body, timeout=300) as resp:
                assert resp.status_code == 200, resp.read().decode()
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        self.chunks.append(chunk)
        except BaseException as exc:  # handed to the test thread by result()
            self.error = exc
        finally:
            self.done.set()


def _accumulated(chunks: list[dict]) -> tuple[str | None, list[tuple[str, str, str]], str]:
    """The stream as the openai client accumulates it: content, (id, name, arguments) of
    each call, finish reason."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    choice = state.current_completion_snapshot.choices[0]
    calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, str(choice.finish_reason)


def _without_ids(answer: tuple[str | None, list[tuple[str, str, str]], str]) -> tuple:
    content, calls, reason = answer
    return content, [(name, arguments) for _, name, arguments in calls], reason


def _busy_decoder(dep: Deployment, client: Streamer) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for url in dep.decoders:
            if _metric(url, "kvferry:num_requests_running") > 0:
                return url
        if client.done.is_set():  # ended before a decoder was seen running: say how
            chunks = client.result()
            raise AssertionError(f"the answer ended before a decoder was seen running it: {chunks[-2:]}")
        time.sleep(0.005)
    raise AssertionError(f"no decoder started the request in 60 s:\n{dep.log.read_text()[-3000:]}")


def _wait_idle(url: str, timeout: float = 30.0) -> None:
    """Once nothing runs or waits on the instance and every KV block is free again."""

    def idle() -> bool:
        running = _metric(url, "kvferry:num_requests_running") + _metric(url, "kvferry:num_requests_waiting")
        return running == 0 and _metric(url, "kvferry:num_free_blocks") == _metric(url, "kvferry:num_blocks")

    deadline = time.monotonic() + timeout
    while not idle():
        assert time.monotonic() < deadline, f"{url}: not idle, or KV blocks not freed"
        time.sleep(0.1)


NAMED = {"type": "function", "function": {"name": "record"}}
AUTO_CALL = r'\{"name": "record", "arguments": \{"digits": \[[0-9](,[0-9]){59}\]\}\}'

CASES = [
    pytest.param({"tool_choice": "required"}, id="required"),
    # the proxy sends the prefill's token early, as the call's announcement (early_calls.py)
    pytest.param({"tool_choice": NAMED}, id="named"),
    pytest.param({"tool_choice": NAMED, "logprobs": True}, id="named-logprobs"),  # nothing early
    # auto: the tiny model's template writes a call as a JSON object (Llama 3's form); a
    # regex makes the random model write one
    pytest.param({"tool_choice": "auto", "structured_outputs": {"regex": AUTO_CALL}}, id="auto"),
]


@pytest.mark.parametrize("fields", CASES)
def test_a_call_streamed_across_a_killed_decoder_equals_a_colocated_one(
    deployment: Deployment, fields: dict
) -> None:
    dep = deployment
    _wait("both decoders in /health", lambda: all(_healthy(dep, url) for url in dep.decoders), dep)
    body = {**REQUEST, **fields}
    colocated = _accumulated(Streamer(dep.decoders[0], body).result())
    [(_, name, arguments)] = colocated[1]
    assert name == "record" and colocated[2] == "tool_calls"
    jsonschema.validate(json.loads(arguments), SCHEMA)
    _wait_idle(dep.decoders[0])
    failovers = _metric(dep.proxy, "kvferry_proxy:decode_failovers_total")
    client = Streamer(dep.proxy, body)
    victim = _busy_decoder(dep, client)
    pid = dep.instance_pid(victim)
    assert pid is not None
    _wait(
        "the call under way", lambda: client.calls_chunks() >= CALLS_BEFORE_KILL or client.done.is_set(), dep
    )
    assert not client.done.is_set(), "the answer ended before the decoder was killed"
    sent = client.calls_chunks()
    _kill_group(pid)
    chunks = client.result()
    assert client.calls_chunks() > sent  # the other decoder wrote the rest of the call
    answer = _accumulated(chunks)
    assert _without_ids(answer) == _without_ids(colocated)
    [(call_id, _, arguments)] = answer[1]
    assert call_id.startswith("call_") and call_id.count("call_") == 1  # announced once
    jsonschema.validate(json.loads(arguments), SCHEMA)
    assert _metric(dep.proxy, "kvferry_proxy:decode_failovers_total") == failovers + 1
    survivor = next(url for url in dep.decoders if url != victim)
    _wait_idle(survivor)
    _wait_idle(dep.prefill)
    _wait("the restarted decoder in /health", lambda: _healthy(dep, victim), dep)


def _healthy(dep: Deployment, decoder: str) -> bool:
    return bool(_decoder_health(dep.proxy, decoder)[1]["healthy"])
