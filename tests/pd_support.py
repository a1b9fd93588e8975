"""Helpers for the P/D end-to-end tests: `kvferry serve` processes with the NixlConnector.

No tests here. Servers run in their own process groups (a kill takes the API server, the
engine core and its workers down at once); every helper talks plain HTTP. A Relay in
front of an instance shows a test what the proxy got from it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from kvferry.ports import free_port
from tests import plain_http
from tests.forked_cli import Command
from tests.proxy_fakes import start_cli
from tests.proxy_fakes import stop as stop_procs
from tests.proxy_fakes import wait_healthy as wait_proc_healthy

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"


@dataclass
class Server:
    name: str
    proc: Command
    url: str
    log: Path

    def post(self, body: dict, timeout: float = 60.0) -> httpx.Response:
        return plain_http.post(self.url + "/v1/completions", json={"model": MODEL, **body}, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Every kvferry: sample of /metrics, by name (labels dropped; counters without _total)."""
        out: dict[str, float] = {}
        for line in plain_http.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("kvferry:") and " " in line:
                key, _, value = line.rpartition(" ")
                name = key.split("{")[0].removeprefix("kvferry:").removesuffix("_total")
                if "_bucket" not in name and "le=" not in key:
                    out[name] = (
                        out.get(name, 0.0) + float(value) if "finished_reason" in key else float(value)
                    )
        return out

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def start_server(
    model_dir: Path,
    log_dir: Path,
    name: str,
    kv: dict | None = None,
    tp: int = 1,
    layout: str = "NHD",
    args: tuple[str, ...] = (),
    log_level: str = "WARNING",
) -> Server:
    """Start `kvferry serve` (not waiting for it); kv: the --kv-transfer-config object."""
    port = free_port()
    cmd = ["--log-level", log_level, "serve", str(model_dir)]
    cmd += ["--served-model-name", MODEL, "--port", str(port), "--kv-cache-memory", "0.005"]
    cmd += ["--kv-layout", layout, "--tensor-parallel-size", str(tp), *eager_unless_capture_asked(args)]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    log = log_dir / f"{name}.log"
    return Server(name, start_cli(cmd, log), f"http://127.0.0.1:{port}", log)


def eager_unless_capture_asked(args: Sequence[str]) -> list[str]:
    """A test's server runs eager unless its flags ask for the captured forward (--capture):
    compiling costs each start-up tens of seconds on a 2-core host, and test_capture and the
    tests passing --capture prove the compiled path."""
    asked = any(arg in ("--capture", "--enforce-eager") for arg in args)
    return [*args] if asked else [*args, "--enforce-eager"]


@dataclass(frozen=True)
class ServerSpec:
    """One `kvferry serve` of a deployment: its --kv-transfer-config, TP size, layout, flags."""

    kv: dict | None
    tp: int = 1
    layout: str = "NHD"
    args: tuple[str, ...] = ()


@contextmanager
def serving(model_dir: Path, log_dir: Path, specs: dict[str, ServerSpec]) -> Iterator[dict[str, Server]]:
    """Start one server per spec (by name), yield them once all are healthy; on exit stop
    them all, and each must have exited 0."""
    started: dict[str, Server] = {}
    try:
        for name, spec in specs.items():
            started[name] = start_server(
                model_dir, log_dir, name, spec.kv, tp=spec.tp, layout=spec.layout, args=spec.args
            )
        wait_healthy(list(started.values()))
        yield started
    finally:
        codes = stop(list(started.values()))
    assert codes == [0] * len(started), {s.name: s.tail() for s in started.values()}


def tp_matrix(p1_args: tuple[str, ...], others_args: tuple[str, ...] | None = None) -> dict[str, ServerSpec]:
    """P/D across TP sizes: producers p1 (TP=1) and p2 (TP=2), consumers d1 (TP=1) and d2
    (TP=2, HND: converts NHD on receive). p1 runs `p1_args`, the others `others_args`
    (default: the same)."""
    others = p1_args if others_args is None else others_args
    return {
        "p1": ServerSpec(nixl("producer"), args=p1_args),
        "p2": ServerSpec(nixl("producer"), tp=2, args=others),
        "d1": ServerSpec(nixl("consumer"), args=others),
        "d2": ServerSpec(nixl("consumer"), tp=2, layout="HND", args=others),
    }


def nixl(role: str, policy: str = "fail", **extra) -> dict:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": extra,
    }


def wait_healthy(servers: list[Server], timeout: float | None = None) -> None:
    """Wait until every server answers /health (default: 180 s, or $KVFERRY_TEST_STARTUP_S
    on a host too loaded for that)."""
    timeout = timeout or float(os.environ.get("KVFERRY_TEST_STARTUP_S", "180"))
    deadline = time.monotonic() + timeout
    for server in servers:
        while True:
            if server.proc.poll() is not None:
                raise AssertionError(f"{server.name} exited with {server.proc.returncode}:\n{server.tail()}")
            try:
                if plain_http.get(server.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{server.name} not healthy after {timeout} s:\n{server.tail()}")
            time.sleep(0.2)


def stop(servers: list[Server], timeout: float = 30.0) -> list[int]:
    """SIGINT all, wait, then SIGKILL what is left of their process groups; the exit codes."""
    for server in servers:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout
    for server in servers:
        try:
            server.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        kill(server)
    return [s.proc.wait() for s in servers]


def kill(server: Server) -> None:
    """SIGKILL the server's whole process group (API server, engine core, workers)."""
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_idle(server: Server, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once nothing runs or waits and every KV block is free again (else fail)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (
            m["num_requests_running"] == 0
            and m["num_requests_waiting"] == 0
            and m["num_free_blocks"] == m["num_blocks"]
        ):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{server.name}: {m['num_blocks'] - m['num_free_blocks']} KV blocks not freed: {m}"
            )
        time.sleep(0.1)


def pages_all_returned(server: Server, timeout: float = 30.0) -> dict[str, float]:
    """Once an elastic server's workers returned every page they mapped (the return reaches
    them with the engine's next step): its /metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["kv_pages_mapped"] == m["kv_pages_returned"] and m["kv_resident_bytes"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.name}: pages not all returned: {m}")
        time.sleep(0.1)


@contextmanager
def proxying(pairs: dict[str, tuple[Server, Server]], log_dir: Path) -> Iterator[dict[str, str]]:
    """One `kvferry proxy` per (prefiller, decoder) pair, by pair name: its URL. On exit
    each must stop with exit code 0."""
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    try:
        for pair, (prefiller, decoder) in pairs.items():
            port = free_port()
            args = ["--log-level", "WARNING", "proxy", "--prefill", prefiller.url, "--decode", decoder.url]
            procs[pair] = start_cli(
                [*args, "--port", str(port), "--health-interval", "1"], log_dir / f"{pair}.log"
            )
            urls[pair] = f"http://127.0.0.1:{port}"
        for pair, proc in procs.items():
            wait_proc_healthy(proc, urls[pair], log_dir / f"{pair}.log")
        yield urls
    finally:
        codes = stop_procs(list(procs.values()))
    assert codes == [0] * len(procs), [(log_dir / f"{pair}.log").read_text()[-3000:] for pair in procs]


@dataclass(frozen=True)
class Completion:
    """One /v1/completions answer as a client sees it."""

    text: str
    token_ids: list[int]
    cached: int | None  # prompt tokens the decoder did not compute (None: streamed, not reported)


def complete(url: str, prompt: str | list[int], max_tokens: int, stream: bool) -> Completion:
    """A greedy completion from `url` (a proxy or a server), streamed or not."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"return_token_ids": True, "stream": stream}
    if not stream:
        resp = plain_http.post(url + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        choice, usage = resp.json()["choices"][0], resp.json()["usage"]
        return Completion(
            choice["text"], choice["token_ids"], usage["prompt_tokens_details"]["cached_tokens"]
        )
    with plain_http.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    ids = [i for c in choices for i in c.get("token_ids") or []]
    return Completion("".join(c["text"] for c in choices), ids, None)


def prefill(server: Server, prompt: str | list[int]) -> dict:
    """The prefill leg: max_tokens=1, do_remote_decode; returns the response's kv_transfer_params."""
    body = {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    resp = server.post(body)
    assert resp.status_code == 200, resp.text
    params = resp.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    return params


def decode(
    server: Server, prompt: str | list[int], params: dict | None, max_tokens: int = 12
) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    return server.post(body)


def colocated_greedy(
    model_dir: Path, prompts: list[str | list[int]], max_tokens: int, **options: object
) -> list:
    """A colocated float32 engine's greedy completions (CompletionOutput), the reference P/D
    answers must equal; 5 MiB of KV and 64-token steps, as the P/D servers here run.
    `options`: more LLM options (e.g. dtype, kv_layout)."""
    from kvferry.engine.llm import LLM
    from kvferry.sampling_params import SamplingParams

    defaults = {
        "dtype": "float32",
        "kv_cache_bytes": 5 << 20,
        "max_num_batched_tokens": 64,
        "enforce_eager": True,
    }
    llm = LLM(str(model_dir), **{**defaults, **options})
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    finally:
        llm.engine.shutdown()
    return [o.outputs[0] for o in outs]


def prompt_set(tokenizer, block_size: int = 16) -> list[str | list[int]]:
    """>= 16 prompts: below one block, exact block multiples (token ids), long (chunked prefill)."""
    texts = [
        "the cat",
        "hello",
        "a small bird follows the river",
        "the queen writes a letter to the king because it is late",
        "my friend builds a long road near the house every day and the teacher reads a book",
        "the engineer carries a heavy box before the rain and the children paint the blue sky at night "
        "while the captain opens the golden door of the ancient castle by the sea",
        " ".join(["the old man reads a golden book by the sea"] * 12),  # long: chunked
        " ".join(["our team finds a bright star in the morning"] * 20),  # longer
    ]
    base = tokenizer.encode(" ".join(["a dog sees the red ball"] * 40))
    exact = [base[: n * block_size] for n in (1, 2, 3, 5)]
    odd = [base[:1], base[: block_size - 1], base[: block_size + 1], base[: 4 * block_size - 1]]
    return texts + exact + odd


class Relay:
    """An HTTP relay in front of one instance that keeps every POST's answer: the JSON
    object, or the list of a stream's SSE data objects. Serve ``app`` (e.g. with
    tests.proxy_fakes.serve_in_thread) and point a proxy at it."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.answers: list[dict | list[dict]] = []
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(path: str, request: Request) -> Response:
            client = httpx.AsyncClient(timeout=120)
            upstream = await client.send(
                client.build_request(
                    request.method,
                    f"{self.target}/{path}",
                    content=await request.body(),
                    headers={"content-type": "application/json"},
                ),
                stream=True,
            )
            media_type = upstream.headers.get("content-type", "")
            if "text/event-stream" not in media_type:
                content = await upstream.aread()
                await client.aclose()
                if request.method == "POST":
                    self.answers.append(json.loads(content))
                return Response(content, status_code=upstream.status_code, media_type=media_type)
            events: list[dict] = []
            self.answers.append(events)
            return StreamingResponse(
                self._relay(client, upstream, events), upstream.status_code, media_type=media_type
            )

        return app

    @staticmethod
    async def _relay(client: httpx.AsyncClient, upstream: httpx.Response, events: list[dict]):
        try:
            async for line in upstream.aiter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                yield line + "\n"
        finally:
            await upstream.aclose()
            await client.aclose()
