"""`kvferry disagg` on the tiny llama: prefill and decode instances over the NixlConnector
and the proxy; greedy answers byte-identical to a colocated engine (streamed too); on
SIGTERM everything stops and no process is left behind."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvferry import ports
from kvferry.engine.llm import LLM
from kvferry.entrypoints import disagg
from kvferry.errors import ConfigError
from kvferry.ports import PortPicker
from kvferry.sampling_params import SamplingParams
from tests import plain_http
from tests.proxy_fakes import free_port, start_cli

MODEL = "tiny"
MAX_TOKENS = 12
PROMPTS = [
    "The cat sees a small bird",
    "Count from 3 to ten.",
    " ".join(["the old man reads a golden book by the sea"] * 5),  # several KV blocks
]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
READY = re.compile(r"proxy ready at (\S+) \(prefill: (\S+); decode: (\S+);")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    disagg.add_args(parser)
    return parser.parse_args(argv)


def test_the_proxys_port_is_never_an_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy binds --port only once the instances are up: the ports they are given are
    chosen around it (a soak once had its decoder take the proxy's port)."""
    picker = PortPicker(seed=3)
    taken = PortPicker(seed=3).pick()  # the port the picker would hand out first
    monkeypatch.setattr(ports, "PORTS", picker)
    args = _parse(["m", "--port", str(taken), "--prefill", "2", "--decode", "2"])
    disagg._check_args(args)
    instances = disagg.plan_instances(args, {}, Path("/tmp"))
    assert all(not child.url.endswith(f":{taken}") for child in instances)
    assert all(child.side_channel_port != taken for child in instances)


def test_engine_options_pass_through_and_roles_get_their_connector() -> None:
    args = _parse(
        ["m", "--dtype", "float32", "--kv-cache-memory", "0.5", "--no-prefix-caching", "--decode-tp", "2"]
    )
    assert disagg.engine_argv(args) == [
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "0.5",
        "--no-prefix-caching",
    ]
    assert disagg.engine_argv(_parse([])) == []
    edge = _parse(["m", "--metrics-public", "--max-request-body", "1000"])
    assert (
        disagg.engine_argv(edge)
        == disagg.edge_argv(edge)
        == ["--max-request-body", "1000", "--metrics-public"]
    )
    assert disagg.edge_argv(_parse(["m", "--dtype", "float32"])) == []
    config = json.loads(
        disagg.kv_transfer_json("NixlConnector", "prefill", {"lease_s": 10}, 5600, "recompute")
    )
    assert config["kv_role"] == "producer" and config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"] == {
        "side_channel_host": "127.0.0.1",
        "side_channel_port": 5600,
        "lease_s": 10,
    }
    config = json.loads(disagg.kv_transfer_json("NixlConnector", "decode", {}, None, None))
    assert config == {"kv_connector": "NixlConnector", "kv_role": "consumer", "kv_connector_extra_config": {}}
    assert disagg.kv_transfer_json("none", "prefill", {}, 5600, None) is None
    with pytest.raises(ConfigError, match="--kv-connector none"):
        disagg.check_connector(_parse(["--kv-connector", "NoSuchConnector"]))


def _proc_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]  # state, starttime (field 22)


def _descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every live descendant of ``pid``."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                start = _proc_start_time(child)
                if start is not None and child not in found:
                    found[child] = start
                    todo.append(child)
    return found


def _wait_ready(proc: subprocess.Popen, log: Path, timeout: float | None = None) -> re.Match:
    """The ready line (default wait: 120 s, or $KVFERRY_TEST_STARTUP_S on a loaded host)."""
    timeout = timeout or float(os.environ.get("KVFERRY_TEST_STARTUP_S", "120"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = READY.search(log.read_text(errors="replace"))
        if match:
            return match
        if proc.poll() is not None:
            pytest.fail(f"disagg exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"disagg not ready after {timeout} s:\n{log.read_text()[-4000:]}")


def _disagg_args(model: Path, port: int, log_dir: Path, *extra: str) -> list[str]:
    args = ["--log-level", "INFO", "disagg", str(model), "--prefill", "1", "--decode", "1"]
    args += ["--port", str(port), "--log-dir", str(log_dir), "--served-model-name", MODEL]
    return args + ["--kv-cache-memory", "0.005", "--enforce-eager", *extra]


@pytest.fixture(scope="module")
def deployment(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """`kvferry disagg` with the default connector (NixlConnector), started and ready."""
    tmp = tmp_path_factory.mktemp("disagg")
    log = tmp / "disagg.log"
    proc = start_cli(_disagg_args(tiny_llama, free_port(), tmp / "logs"), log)
    try:
        yield Deployment(proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Deployment:
    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc = proc
        self.log = log
        self._ready: re.Match | None = None

    def ready(self) -> tuple[str, str, str]:
        """(proxy, prefill, decode) URLs once everything is healthy."""
        if self._ready is None:
            self._ready = _wait_ready(self.proc, self.log)
        return self._ready.groups()


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, deployment: Deployment) -> dict:
    """Greedy answers of the colocated offline engine (computed while the deployment starts)."""
    llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20, enforce_eager=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    outs = llm.generate(PROMPTS, params)
    chat = llm.chat(MESSAGES, params)[0].outputs[0].text
    return {"completions": {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}, "chat": chat}


def _completion(url: str, prompt: str, stream: bool) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))


def test_pd_over_nixl_is_byte_identical_to_a_colocated_engine(
    deployment: Deployment, reference: dict
) -> None:
    proxy, prefill, decode = deployment.ready()
    for prompt in PROMPTS:
        assert _completion(proxy, prompt, stream=False) == reference["completions"][prompt], prompt
        assert _completion(proxy, prompt, stream=True) == reference["completions"][prompt], prompt
    client = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0)
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
    assert client.chat.completions.create(**kwargs).choices[0].message.content == reference["chat"]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["chat"]
    assert _metric(decode, "kvferry:kv_connector_nixl_bytes_read_total") > 0  # the KV came over NIXL
    _wait_blocks_free(prefill)  # every lease was released by the decoder's reads
    _wait_blocks_free(decode)


def test_pd_concurrent_streams(deployment: Deployment, reference: dict) -> None:
    proxy, prefill, _ = deployment.ready()

    async def go() -> list[str]:
        async with openai.AsyncOpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0) as client:

            async def one(prompt: str) -> str:
                s = await client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
                )
                return "".join([c.choices[0].text async for c in s])

            return await asyncio.gather(*(one(p) for p in PROMPTS * 2))

    assert asyncio.run(go()) == [reference["completions"][p] for p in PROMPTS * 2]
    _wait_blocks_free(prefill)


def _affinity(pid: int) -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(pid))
    except OSError:
        return None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to split")
def test_prefill_and_decode_engines_run_on_disjoint_cores(deployment: Deployment) -> None:
    deployment.ready()
    everything = frozenset(os.sched_getaffinity(0))
    family = _descendants(deployment.proc.pid)
    pinned = {_affinity(pid) for pid in family} - {everything, None}
    assert len(pinned) == 2, pinned  # the prefill and the decode engine, each on its own cores
    first, second = pinned
    assert first and second and not first & second


@pytest.mark.slow  # several seconds (make test-all)
def test_sigterm_leaves_nothing_behind(deployment: Deployment) -> None:
    urls = deployment.ready()
    proc = deployment.proc
    family = _descendants(proc.pid)
    assert len(family) >= 5, family  # prefill, decode, proxy, and each server's engine core
    for url in urls:
        assert plain_http.get(url + "/health").status_code == 200
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    assert code == 0, deployment.log.read_text()[-4000:]
    left = {pid for pid, start in family.items() if _proc_start_time(pid) == start}
    assert not left, f"processes left behind: {left}"
    log = deployment.log.read_text()
    assert "all stopped" in log
    assert log.count("stopped (exit code 0)") == 3, log[-4000:]  # proxy, prefill, decode: clean exits


def _metric(url: str, name: str) -> float:
    for line in plain_http.get(url + "/metrics").text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] == name:
            return float(value)
    return 0.0


def _wait_blocks_free(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(url, "kvferry:num_free_blocks") != _metric(url, "kvferry:num_blocks"):
        assert time.monotonic() < deadline, f"KV blocks of {url} not freed"
        time.sleep(0.1)


# ---- process management, with stand-in processes --------------------------------------


def _child(tmp_path: Path, name: str, code: str) -> disagg.Child:
    return disagg.Child(name, [sys.executable, "-c", code], "http://127.0.0.1:9", tmp_path / f"{name}.log")


@pytest.mark.slow  # starts `kvferry disagg` or its children again
def test_an_instance_that_dies_while_starting_is_reported_with_its_log(tmp_path: Path) -> None:
    child = _child(tmp_path, "decode-0", "print('no model at /nowhere', flush=True); raise SystemExit(3)")
    disagg.spawn(child)
    with pytest.raises(disagg.LaunchError, match=r"decode-0 exited with code 3 while starting") as err:
        disagg.wait_healthy([child], time.monotonic() + 30, threading.Event())
    assert "no model at /nowhere" in str(err.value)


@pytest.mark.slow  # starts `kvferry disagg` or its children again
def test_stop_kills_what_ignores_sigterm_and_its_whole_group(tmp_path: Path) -> None:
    stubborn = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "p = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']);"
        "print(p.pid, flush=True); time.sleep(60)"
    )
    polite = _child(tmp_path, "proxy", "import time; time.sleep(60)")
    hard = _child(tmp_path, "prefill-0", stubborn)
    for child in (polite, hard):
        disagg.spawn(child)
    deadline = time.monotonic() + 30
    while not hard.log.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(hard.log.read_text().split()[0])
    begin = time.monotonic()
    disagg.stop_all([polite, hard], grace=1.0)
    assert time.monotonic() - begin < 10
    assert polite.proc.returncode != 0 and hard.proc.returncode == -signal.SIGKILL
    assert _proc_start_time(grandchild) is None  # killed with its group (stop_all waits), not orphaned


@pytest.mark.slow  # starts `kvferry disagg` or its children again
def test_children_stop_when_the_launcher_is_killed(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    launcher = (
        "import sys, time; from pathlib import Path; from kvferry.entrypoints import disagg;"
        f"c = disagg.Child('x', [sys.executable, '-c', 'import time; time.sleep(60)'], '', Path({str(log)!r}));"
        "disagg.spawn(c); print(c.proc.pid, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, cwd=disagg_root())
    child = int(proc.stdout.readline())
    proc.kill()  # SIGKILL: no chance to clean up; the child gets SIGINT from the kernel
    proc.wait()
    deadline = time.monotonic() + 20
    while _proc_start_time(child) is not None:
        assert time.monotonic() < deadline, "the child outlived its launcher"
        time.sleep(0.05)


def disagg_root() -> Path:
    return Path(__file__).resolve().parent.parent
