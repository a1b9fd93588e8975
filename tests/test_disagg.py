"""`kvferry disagg`: the launcher starts prefill, decode and proxy processes, serves through
the proxy, and on SIGTERM stops them all, leaving no process behind."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvferry.entrypoints import disagg
from kvferry.errors import ConfigError
from tests.test_proxy_fakes import free_port, start_cli

MODEL = "tiny"
READY = re.compile(r"proxy ready at (\S+) \(prefill: (\S+); decode: (\S+);")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    disagg.add_args(parser)
    return parser.parse_args(argv)


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
    raw = disagg.kv_transfer_json("NixlConnector", "decode", {"x": 1}, 5600, "recompute")
    config = json.loads(raw)
    assert config["kv_role"] == "consumer" and config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"]["side_channel_port"] == 5600
    assert config["kv_connector_extra_config"]["x"] == 1
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


def _wait_ready(proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> re.Match:
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
    return args + ["--kv-cache-memory", "0.005", *extra]


def test_disagg_serves_and_sigterm_leaves_nothing_behind(tiny_llama: Path, tmp_path: Path) -> None:
    log = tmp_path / "disagg.log"
    proc = start_cli(_disagg_args(tiny_llama, free_port(), tmp_path / "logs", "--kv-connector", "none"), log)
    try:
        proxy, prefill, decode = _wait_ready(proc, log).groups()
        family = _descendants(proc.pid)
        assert len(family) >= 5, family  # prefill, decode, proxy, and each server's engine core
        for url in (proxy, prefill, decode):
            assert httpx.get(url + "/health").status_code == 200
        answers = []
        for url in (proxy, decode):
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            chunks = client.completions.create(
                model=MODEL, prompt="The cat sees a small bird", max_tokens=8, temperature=0, stream=True
            )
            answers.append("".join(c.choices[0].text for c in chunks))
        assert answers[0] == answers[1] and answers[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert code == 0, log.read_text()[-4000:]
    left = {pid for pid, start in family.items() if _proc_start_time(pid) == start}
    assert not left, f"processes left behind: {left}"
    assert "all stopped" in log.read_text()


def test_disagg_startup_failure_shows_the_log_and_cleans_up(tmp_path: Path) -> None:
    log = tmp_path / "disagg.log"
    proc = start_cli(
        _disagg_args(tmp_path / "no-such-model", free_port(), tmp_path / "logs", "--kv-connector", "none"),
        log,
    )
    code = proc.wait(120)
    text = log.read_text()
    assert code == 2, text
    assert re.search(r"kvferry: error: (prefill|decode)-0 exited with code \d+ while starting", text), text
    assert "no-such-model" in text.split("kvferry: error:", 1)[1]  # the instance's own log tail
    assert "stopped (exit code" in text
