"""`kvferry disagg` keeps serving when one of its instances dies: 1 prefiller and 2
decoders (NIXL) on the tiny llama, a few clients streaming greedy answers; one decoder is
SIGKILLed mid-answer. The answers in flight continue on the other decoder byte for byte
as a colocated engine gives them, no client sees an error, the launcher stays up and
restarts the decoder on its port; the proxy's /health and /metrics report it down, then
back (one restart), and route to it again. Then the prefiller is killed: restarted, it
serves again (the decoders pull its KV); killed past its last allowed restart
(--max-restarts 1), no prefill instance is left, so the launcher stops everything and
exits non-zero, saying why."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvferry.engine.llm import LLM
from kvferry.ports import free_port
from kvferry.sampling_params import SamplingParams
from tests import plain_http
from tests.test_disagg import _descendants, _proc_start_time

ROOT = Path(__file__).resolve().parent.parent

MODEL = "tiny"
MAX_TOKENS = 160
PROMPTS = [
    "The cat sees a small bird and",
    "Count from 3 to ten.",
    "The old man reads a golden book by the sea",
    "Tell me a story about a cat.",
]
CLIENTS = 4
ANSWERS_PER_CLIENT = 2  # streamed one after the other
CHUNKS_BEFORE_KILL = 10  # a client has this much of an answer when the decoder is killed
READY = re.compile(r"proxy ready at (\S+) \(prefill: ([^;]+); decode: ([^;]+);")


@dataclass
class Deployment:
    proc: subprocess.Popen
    log: Path
    proxy: str
    prefill: str
    decoders: list[str]

    def instance_pid(self, url: str) -> int | None:
        """The launcher's child serving on ``url``'s port (the leader of its process group)."""
        port = url.rpartition(":")[2].encode()
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for pid in children:
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"serve" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == port:
                    return pid
        return None

    def running(self) -> None:
        assert self.proc.poll() is None, f"the launcher exited:\n{self.log.read_text()[-4000:]}"


def _wait_ready(proc: subprocess.Popen, log: Path, timeout: float = 600.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = READY.search(log.read_text(errors="replace"))
        if match:
            return match
        assert proc.poll() is None, f"disagg exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)
    raise AssertionError(f"disagg not ready after {timeout} s:\n{log.read_text()[-4000:]}")


@contextlib.contextmanager
def disagg_launched(
    model: Path, tmp: Path, served_name: str, max_restarts: int
) -> Iterator[tuple[subprocess.Popen, Path]]:
    """`kvferry disagg` 1P+2D started (not yet ready) with its log, killed on the way out;
    each process restarted at most `max_restarts` times."""
    log = tmp / "disagg.log"
    args = ["--log-level", "INFO", "disagg", str(model), "--prefill", "1", "--decode", "2"]
    args += ["--port", str(free_port()), "--log-dir", str(tmp / "logs"), "--served-model-name", served_name]
    # eager (no compile at each start) and one thread each: three engines share the cores
    args += ["--kv-cache-memory", "0.02", "--enforce-eager", "--cpu-threads", "1", "--health-interval", "0.5"]
    args += ["--max-restarts", str(max_restarts), "--restart-backoff", "0.5"]
    cmd = [sys.executable, "-m", "kvferry.entrypoints.cli", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def launched(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[subprocess.Popen, Path]]:
    """`kvferry disagg` 1P+2D started (not yet ready), at most 1 restart per process."""
    with disagg_launched(tiny_llama, tmp_path_factory.mktemp("disagg-restart"), MODEL, 1) as started:
        yield started


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, launched: tuple[subprocess.Popen, Path]) -> dict[str, str]:
    """Greedy answers of the colocated offline engine (computed while the deployment starts)."""
    llm = LLM(str(tiny_llama), kv_cache_bytes=32 << 20, enforce_eager=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return {p: out.outputs[0].text for p, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True)}


@pytest.fixture(scope="module")
def deployment(launched: tuple[subprocess.Popen, Path], reference: dict[str, str]) -> Deployment:
    proc, log = launched
    proxy, prefill, decode = _wait_ready(proc, log).groups()
    return Deployment(proc, log, proxy, prefill, decode.split())


class Streamer:
    """One client in a thread: streams ANSWERS_PER_CLIENT greedy completions one after another."""

    def __init__(self, proxy: str, first: int) -> None:
        self.url = proxy + "/v1/completions"
        self.first = first
        self.answers: list[tuple[str, str]] = []  # (prompt, text)
        self.failures: list[str] = []
        self.chunks = 0  # of the answer under way
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def finish(self, timeout: float = 600.0) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "a client's answer did not end"

    def _run(self) -> None:
        for i in range(self.first, self.first + ANSWERS_PER_CLIENT):
            prompt = PROMPTS[i % len(PROMPTS)]
            try:
                self.answers.append((prompt, self._one(prompt)))
            except Exception as exc:  # recorded, asserted on by the test
                self.failures.append(f"{prompt!r}: {exc!r}")

    def _one(self, prompt: str) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        body |= {"ignore_eos": True, "stream": True}
        self.chunks = 0
        pieces = []
        with plain_http.stream("POST", self.url, json=body, timeout=300) as resp:
            if resp.status_code != 200:
                raise AssertionError(f"HTTP {resp.status_code}: {resp.read().decode()}")
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    pieces.append(chunk["choices"][0]["text"])
                    self.chunks += 1
        return "".join(pieces)


def _metric(url: str, name: str, label: str = "") -> float:
    """The sum of ``name``'s samples whose labels contain ``label``."""
    total = 0.0
    for line in plain_http.get(url + "/metrics", timeout=10).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] == name and label in key:
            total += float(value)
    return total


def _wait(what: str, ready: Callable[[], bool], dep: Deployment, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dep.running()
        assert time.monotonic() < deadline, f"{what} not seen in {timeout} s"
        time.sleep(0.05)


def _decoder_health(proxy: str, url: str) -> tuple[dict, dict]:
    """(the decode role's up/down counts, the instance's entry) in the proxy's /health."""
    health = plain_http.get(proxy + "/health", timeout=5).json()
    entry = next(i for i in health["instances"]["decode"] if i["url"] == url)
    return health["roles"]["decode"], entry


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _complete(proxy: str, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    resp = plain_http.post(proxy + "/v1/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_killed_decoder_is_restarted_while_the_other_serves(
    deployment: Deployment, reference: dict[str, str]
) -> None:
    dep, victim = deployment, deployment.decoders[1]
    pid = dep.instance_pid(victim)
    assert pid is not None
    failovers = _metric(dep.proxy, "kvferry_proxy:decode_failovers_total")
    clients = [Streamer(dep.proxy, first=k) for k in range(CLIENTS)]
    try:
        # mid-answer: the victim decodes, and a client has part of an answer
        _wait("a busy victim", lambda: _metric(victim, "kvferry:num_requests_running") > 0, dep)
        _wait("answers under way", lambda: max(c.chunks for c in clients) >= CHUNKS_BEFORE_KILL, dep)
        _kill_group(pid)
        _wait(
            "the dead decoder in /health", lambda: not _decoder_health(dep.proxy, victim)[1]["healthy"], dep
        )
        roles, entry = _decoder_health(dep.proxy, victim)
        assert roles == {"up": 1, "down": 1} and entry["restarts"] == 0, entry
        assert _metric(dep.proxy, "kvferry_proxy:instances", 'role="decode",state="down"') == 1
    finally:
        for client in clients:
            client.finish()
    dep.running()
    assert [f for c in clients for f in c.failures] == []
    answers = [a for c in clients for a in c.answers]
    assert len(answers) == CLIENTS * ANSWERS_PER_CLIENT
    assert [text for _, text in answers] == [reference[prompt] for prompt, _ in answers]
    assert _metric(dep.proxy, "kvferry_proxy:decode_failovers_total") > failovers  # moved mid-answer
    assert _metric(dep.proxy, "kvferry_proxy:requests_total", 'status="5') == 0
    # the launcher polls its children every 0.5 s: the answers can all be in before it looks
    _wait(
        "the launcher's restart",
        lambda: "decode-1 exited with code -9; restarting it" in dep.log.read_text(),
        dep,
    )

    _wait("the restarted decoder in /health", lambda: _decoder_health(dep.proxy, victim)[1]["healthy"], dep)
    roles, entry = _decoder_health(dep.proxy, victim)
    assert roles == {"up": 2, "down": 0} and entry["restarts"] == 1, entry
    assert _metric(dep.proxy, "kvferry_proxy:instance_restarts_total", victim) == 1
    new_pid = dep.instance_pid(victim)
    assert new_pid is not None and new_pid != pid  # the same port, a new process
    # requests after the recovery: answered, and the proxy routes to the restarted decoder again
    for prompt in PROMPTS[:3]:  # round robin: at least one of three on each decoder
        assert _complete(dep.proxy, prompt) == reference[prompt]
    assert _metric(victim, "kvferry:request_success_total") > 0
    # its KV came over NIXL: it proved the side channel's secret, the same as before
    assert _metric(victim, "kvferry:kv_connector_nixl_bytes_read_total") > 0
    dep.running()


def _prefill_health(proxy: str) -> dict:
    return dict(plain_http.get(proxy + "/health", timeout=5).json()["instances"]["prefill"][0])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_restarted_prefiller_serves_then_the_launcher_ends_once_it_is_down_for_good(
    deployment: Deployment, reference: dict[str, str]
) -> None:
    dep = deployment
    family = _descendants(dep.proc.pid)
    first = dep.instance_pid(dep.prefill)
    assert first is not None
    _kill_group(first)  # restarted: its one allowed restart
    _wait("the dead prefiller in /health", lambda: not _prefill_health(dep.proxy)["healthy"], dep)
    _wait("the restarted prefiller in /health", lambda: _prefill_health(dep.proxy)["healthy"], dep)
    assert _prefill_health(dep.proxy)["restarts"] == 1
    # the decoders take KV from the new run (a new engine, the same side-channel port and secret)
    read = sum(_metric(url, "kvferry:kv_connector_nixl_bytes_read_total") for url in dep.decoders)
    assert _complete(dep.proxy, PROMPTS[1]) == reference[PROMPTS[1]]
    assert sum(_metric(url, "kvferry:kv_connector_nixl_bytes_read_total") for url in dep.decoders) > read
    again = dep.instance_pid(dep.prefill)
    assert again is not None and again != first
    family |= _descendants(dep.proc.pid)
    _kill_group(again)  # past --max-restarts: down for good, and it was the only one
    code = dep.proc.wait(120)
    log = dep.log.read_text()
    assert code != 0, log[-4000:]
    assert "no prefill instance left: prefill-0 exited with code -9 and stays down" in log, log[-4000:]
    left = {pid for pid, start in family.items() if _proc_start_time(pid) == start}
    assert not left, f"processes left behind: {left}"
