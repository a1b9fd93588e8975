"""Decode failover over real processes: a prefill and two decode `kvferry serve` instances
(NIXL) behind a `kvferry proxy`. The decoder that is answering is SIGKILLed mid-answer;
the proxy continues the answer on the other decoder (from the token ids already sent,
for a stream), so a greedy or seeded answer, completion or chat, equals the undisturbed
one byte for byte, the proxy's failover counter goes up by 1, and the surviving instances
end with every block free; an n = 3 stream continues each of its answers. A decoder that is dead before the request reaches it (it
refuses the connection) is counted as a moved request. The deployment is shared by the
module: a killed decoder is started again on its port before the next test."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest

from kvferry.entrypoints.proxy.failover import SentTokens, is_role_chunk
from tests import plain_http
from tests.pd_support import Server, kill, nixl, start_server, stop, wait_healthy, wait_idle
from tests.proxy_fakes import free_port, start_cli
from tests.proxy_fakes import stop as stop_procs
from tests.proxy_fakes import wait_healthy as wait_proc_healthy

# slow: three `kvferry serve` processes and a proxy, a decoder killed and restarted (make test-all only)
pytestmark = pytest.mark.slow

COMPLETION = {
    "model": "tiny",
    "prompt": "The cat sees a small bird and",
    "max_tokens": 300,
    "ignore_eos": True,
}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me a story about a cat."}],
    "max_tokens": 300,
    "ignore_eos": True,
}
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
CHUNKS_BEFORE_KILL = 20  # a stream is killed once the client has this many chunks
DECODERS = ("a", "b")


@dataclass
class Deployment:
    model: Path
    log_dir: Path
    servers: dict[str, Server]
    proxy: str

    def start_proxy(self, health_interval: float) -> tuple[subprocess.Popen, str]:
        port = free_port()
        args = ["--log-level", "WARNING", "proxy", "--prefill", self.servers["prefill"].url, "--decode"]
        args += [self.servers[name].url for name in DECODERS]
        args += ["--port", str(port), "--health-interval", str(health_interval)]
        log = self.log_dir / f"proxy-{port}.log"
        proc = start_cli(args, log)
        url = f"http://127.0.0.1:{port}"
        wait_proc_healthy(proc, url, log)
        return proc, url

    def start_again(self, name: str) -> None:
        """Start a killed decoder again on its port (not waiting for it)."""
        old = self.servers[name]
        port = old.url.rpartition(":")[2]
        kv = nixl("consumer", "recompute")
        again = start_server(self.model, self.log_dir, f"{name}-again", kv, args=("--port", port))
        self.servers[name] = Server(name, again.proc, old.url, again.log)

    def wait_back(self, name: str) -> None:
        """Once a decoder started again is healthy, and the proxy sees it so."""
        wait_healthy([self.servers[name]])
        deadline = time.monotonic() + 30
        while not _all_decoders_healthy(self.proxy):
            assert time.monotonic() < deadline, "the proxy does not see the restarted decoder"
            time.sleep(0.1)


def _all_decoders_healthy(proxy: str) -> bool:
    instances = plain_http.get(proxy + "/health", timeout=5).json()["instances"]["decode"]
    return all(inst["healthy"] for inst in instances)


@pytest.fixture(scope="module")
def deployment(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    log_dir = tmp_path_factory.mktemp("failover")
    servers = {
        "prefill": start_server(tiny_llama, log_dir, "prefill", nixl("producer", unknown_grace_s=1.0)),
        **{name: start_server(tiny_llama, log_dir, name, nixl("consumer", "recompute")) for name in DECODERS},
    }
    procs: list[subprocess.Popen] = []
    try:
        wait_healthy(list(servers.values()))
        dep = Deployment(tiny_llama, log_dir, servers, "")
        proc, dep.proxy = dep.start_proxy(health_interval=0.5)
        procs.append(proc)
        yield dep
    finally:
        stop_procs(procs)
        stop(list(servers.values()))


class Client:
    """One request through the proxy in a thread: the answer's text, chunk by chunk."""

    def __init__(self, url: str, path: str, body: dict, stream: bool) -> None:
        self.url, self.path, self.body, self.stream = url + path, path, body, stream
        self.pieces: list[str] = []
        self.by_choice: dict[int, list[str]] = {}  # n > 1: each choice's pieces
        self.role_chunks = 0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Client:
        self._thread.start()
        return self

    def text(self, timeout: float = 120) -> str:
        assert self.done.wait(timeout), "no answer in time"
        if self.error is not None:
            raise self.error
        return "".join(self.pieces)

    def texts(self, timeout: float = 120) -> dict[int, str]:
        """Each choice's text (by index)."""
        self.text(timeout)
        return {index: "".join(pieces) for index, pieces in self.by_choice.items()}

    def _run(self) -> None:
        try:
            self._stream() if self.stream else self._complete()
        except BaseException as exc:  # handed to the test thread by text()
            self.error = exc
        finally:
            self.done.set()

    def _complete(self) -> None:
        resp = plain_http.post(self.url, json=self.body, timeout=120)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        self.pieces.append(choice["message"]["content"] if "messages" in self.body else choice["text"])

    def _stream(self) -> None:
        with plain_http.stream("POST", self.url, json={**self.body, "stream": True}, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    self._chunk(json.loads(line[6:]))

    def _chunk(self, chunk: dict) -> None:
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            assert "token_ids" not in choice and "prompt_token_ids" not in choice  # not asked for
            if "messages" in self.body:
                delta = choice["delta"]
                self.role_chunks += "role" in delta
                piece = delta.get("content") or ""
            else:
                piece = choice["text"]
            self.pieces.append(piece)
            self.by_choice.setdefault(choice["index"], []).append(piece)


def _busy_decoder(servers: dict[str, Server], timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in DECODERS:
            if servers[name].metrics()["num_requests_running"] > 0:
                return name
        time.sleep(0.005)
    raise AssertionError("no decoder started the request")


def _counter(url: str, name: str, label: str = "") -> float:
    """The sum of a proxy counter's samples (those whose labels contain ``label``)."""
    total = 0.0
    for line in plain_http.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"kvferry_proxy:{name}_total") and label in line:
            total += float(line.rpartition(" ")[2])
    return total


def _wait_chunks(client: Client, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(client.pieces) < count:
        assert not client.done.is_set(), "the answer ended before the decoder was killed"
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.005)


# Each case kills a decoder and waits for its restart (about 20 s). Greedy completions,
# streamed and not, are the mid-JSON cases below (with a grammar on top); a request not
# streamed is sent again whole, whatever its sampling.
CASES = [
    pytest.param("/v1/completions", COMPLETION, SEEDED, True, id="completion-seeded-stream"),
    pytest.param("/v1/chat/completions", CHAT, SEEDED, True, id="chat-seeded-stream"),
]


# A long answer under a schema (80 digits: about 160 tokens), so the kill lands mid-JSON.
def digits_schema(count: int) -> dict:
    """An object holding exactly `count` one-digit integers: a long answer of known length."""
    digits = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}}
    return {
        "type": "object",
        "properties": {"digits": {**digits, "minItems": count, "maxItems": count}},
        "required": ["digits"],
        "additionalProperties": False,
    }


LONG_SCHEMA = digits_schema(80)


@pytest.mark.parametrize("stream", [True, False])
def test_killed_decoder_mid_json_continues_the_schema(deployment: Deployment, stream: bool) -> None:
    """A decoder killed while it writes JSON under a schema: the other decoder resumes the
    grammar from the tokens already sent (resumed_output_tokens), so the answer is the
    colocated one (a decoder asked directly) byte for byte, and it validates."""
    servers, url = deployment.servers, deployment.proxy
    request = {**COMPLETION, "ignore_eos": False, "guided_json": LONG_SCHEMA, **GREEDY}
    colocated = Client(servers["a"].url, "/v1/completions", request, stream=False).start().text()
    jsonschema.validate(json.loads(colocated), LONG_SCHEMA)
    wait_idle(servers["a"])
    failovers = _counter(url, "decode_failovers")
    client = Client(url, "/v1/completions", request, stream).start()
    victim = _busy_decoder(servers)
    if stream:
        _wait_chunks(client, CHUNKS_BEFORE_KILL)
    kill(servers[victim])
    servers[victim].proc.wait(10)
    deployment.start_again(victim)
    answer = client.text()
    assert answer == colocated
    jsonschema.validate(json.loads(answer), LONG_SCHEMA)
    assert _counter(url, "decode_failovers") == failovers + 1
    wait_idle(servers["b" if victim == "a" else "a"])
    wait_idle(servers["prefill"])
    deployment.wait_back(victim)


@pytest.mark.parametrize(("path", "body", "sampling", "stream"), CASES)
def test_killed_decoder_answer_continues_on_the_other(
    deployment: Deployment, path: str, body: dict, sampling: dict, stream: bool
) -> None:
    servers, url = deployment.servers, deployment.proxy
    request = {**body, **sampling}
    undisturbed = Client(url, path, request, stream).start().text()
    for name in DECODERS:
        wait_idle(servers[name])
    failovers = _counter(url, "decode_failovers")
    client = Client(url, path, request, stream).start()
    victim = _busy_decoder(servers)
    if stream:
        _wait_chunks(client, CHUNKS_BEFORE_KILL)  # the continuation starts from sent tokens
    kill(servers[victim])
    servers[victim].proc.wait(10)
    deployment.start_again(victim)  # starts while the answer goes on
    assert client.text() == undisturbed
    assert client.role_chunks == (1 if stream and "messages" in body else 0)
    assert _counter(url, "decode_failovers") == failovers + 1
    survivor = "b" if victim == "a" else "a"
    wait_idle(servers[survivor])
    wait_idle(servers["prefill"])
    deployment.wait_back(victim)


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_killed_decoder_mid_n3_stream_continues_every_choice(
    deployment: Deployment, path: str, body: dict
) -> None:
    """n = 3, seeded, streamed: the decoder is killed while all three answers are under way;
    each continues on the other decoder from its own sent tokens with its own seed (seed + i),
    so every choice equals a colocated server's stream (a decoder asked directly), each chat
    choice opens with one role chunk, and one failover is counted."""
    servers, url = deployment.servers, deployment.proxy
    request = {**body, **SEEDED, "n": 3}
    colocated = Client(servers["a"].url, path, request, stream=True).start().texts()
    assert sorted(colocated) == [0, 1, 2] and len(set(colocated.values())) == 3
    wait_idle(servers["a"])
    failovers = _counter(url, "decode_failovers")
    client = Client(url, path, request, stream=True).start()
    victim = _busy_decoder(servers)
    _wait_chunks(client, CHUNKS_BEFORE_KILL)
    kill(servers[victim])
    servers[victim].proc.wait(10)
    deployment.start_again(victim)
    assert client.texts() == colocated
    assert client.role_chunks == (3 if "messages" in body else 0)
    assert _counter(url, "decode_failovers") == failovers + 1
    wait_idle(servers["b" if victim == "a" else "a"])
    wait_idle(servers["prefill"])
    deployment.wait_back(victim)


def test_request_no_decoder_accepted_is_moved_and_counted(deployment: Deployment) -> None:
    """A decoder that died before the request reached it refuses the connection: the
    stream goes whole to the other decoder, counted in requests_moved (not a failover).
    The proxy's health checks are slow here, so it still picks the dead decoder."""
    servers = deployment.servers
    request = {**COMPLETION, **SEEDED}
    undisturbed = Client(deployment.proxy, "/v1/completions", request, True).start().text()
    proc, url = deployment.start_proxy(health_interval=600)
    try:
        kill(servers["a"])  # the proxy's round robin picks the first decoder first
        servers["a"].proc.wait(10)
        assert Client(url, "/v1/completions", request, True).start().text() == undisturbed
        assert _counter(url, "requests_moved", 'role="decode"') == 1
        assert _counter(url, "requests_moved", 'cause="refused"') == 1
        assert _counter(url, "decode_failovers") == 0
        wait_idle(servers["b"])
        wait_idle(servers["prefill"])
    finally:
        stop_procs([proc])
        if servers["a"].proc.poll() is not None:
            deployment.start_again("a")
    deployment.wait_back("a")


def test_resume_body_continues_from_the_sent_token_ids() -> None:
    sent = SentTokens(chat=False)
    first = {"choices": [{"text": "a", "token_ids": [7], "prompt_token_ids": [1, 2, 3]}]}
    sent.record(first, keep_ids=False)
    sent.record({"choices": [{"text": "b", "token_ids": [8, 9]}]}, keep_ids=False)
    assert "token_ids" not in first["choices"][0] and "prompt_token_ids" not in first["choices"][0]
    body = {"prompt": "x y z", "max_tokens": 10, "kv_transfer_params": {"remote_request_id": "r"}}
    resumed = sent.resume_body(body)
    assert resumed["prompt"] == [1, 2, 3, 7, 8, 9] and resumed["max_tokens"] == 7
    assert resumed["resumed_output_tokens"] == 3  # a structured-output grammar resumes after them
    assert "kv_transfer_params" not in resumed and resumed["return_token_ids"] is True
    # the second decoder names its longer prompt; a second failover still starts from the first's
    sent.record({"choices": [{"text": "c", "token_ids": [4], "prompt_token_ids": [1, 2, 3, 7, 8, 9]}]}, False)
    assert sent.resume_body(body)["prompt"] == [1, 2, 3, 7, 8, 9, 4]
    usage = {"usage": {"prompt_tokens": 7, "completion_tokens": 2}}
    sent.fix_usage(usage)
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 6}


def test_chat_resume_body_gives_the_prompt_as_token_ids() -> None:
    sent = SentTokens(chat=True)
    sent.record(
        {"choices": [{"delta": {"content": "a"}, "token_ids": [7], "prompt_token_ids": [1, 2]}]}, False
    )
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "max_tokens": 9}
    resumed = sent.resume_body(body)
    assert resumed["prompt_token_ids"] == [1, 2, 7] and resumed["messages"] == body["messages"]
    assert (resumed["max_completion_tokens"], resumed["max_tokens"]) == (4, 8)
    assert "prompt" not in resumed


def test_only_the_opening_role_chunk_is_a_role_chunk() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    assert is_role_chunk(role)
    assert not is_role_chunk({"choices": [{"delta": {"role": "assistant", "content": "Hi"}}]})
    assert not is_role_chunk({"choices": [{"delta": {"content": "Hi"}}]})
    assert not is_role_chunk({"choices": [], "usage": {"prompt_tokens": 1}})


def test_resume_before_any_chunk_sends_the_request_again() -> None:
    body = {"prompt": "x y z", "max_tokens": 10, "kv_transfer_params": {"remote_request_id": "r"}}
    expected = {"prompt": "x y z", "max_tokens": 10, "return_token_ids": True}
    assert SentTokens(chat=False).resume_body(body) == expected


def test_chat_answers_from_its_prompt_token_ids_as_from_its_messages(deployment: Deployment) -> None:
    """What the proxy continues a chat stream with: the decoder names the templated
    prompt's ids (return_token_ids) and answers the same from them (prompt_token_ids)."""
    url = deployment.servers["a"].url + "/v1/chat/completions"
    body = {**CHAT, **GREEDY, "max_tokens": 12, "return_token_ids": True}
    answer = plain_http.post(url, json=body, timeout=60).json()["choices"][0]
    assert answer["prompt_token_ids"] and len(answer["token_ids"]) == 12
    again = plain_http.post(url, json={**body, "prompt_token_ids": answer["prompt_token_ids"]}, timeout=60)
    assert again.json()["choices"][0]["message"] == answer["message"]
    continued = {**body, "prompt_token_ids": answer["prompt_token_ids"] + answer["token_ids"][:5]}
    rest = plain_http.post(url, json={**continued, "max_tokens": 7}, timeout=60).json()["choices"][0]
    assert rest["token_ids"] == answer["token_ids"][5:]
