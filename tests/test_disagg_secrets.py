"""Secrets never on a command line: `kvferry disagg` hands the API key and the KV side
channel's secret to its children by environment; `kvferry serve` takes the key from a file
or $KVFERRY_API_KEY and refuses P/D with an API key but no side-channel secret."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvferry.connector.nixl.auth import SECRET_ENV
from kvferry.connector.nixl.protocol import Handshake, Refused
from kvferry.entrypoints.http_common import API_KEY_ENV, resolve_api_key
from kvferry.errors import ConfigError
from tests.pd_support import nixl
from tests.proxy_fakes import ROOT, free_port
from tests.test_disagg import _descendants, _disagg_args, _wait_ready
from tests.test_side_channel_auth import RawClient

# slow: starts `kvferry disagg` and `kvferry serve` several times (make test-all only)
pytestmark = pytest.mark.slow

KEY = "sk-disagg-" + "7" * 24


def _launch(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvferry.entrypoints.cli", *args]
    full = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, SECRET_ENV)}
    full.update(env, PYTHONPATH=str(ROOT))
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=full, cwd=ROOT, start_new_session=True
        )


@pytest.fixture(scope="module")
def launched(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    tmp = tmp_path_factory.mktemp("disagg_secrets")
    log = tmp / "disagg.log"
    proc = _launch(_disagg_args(tiny_llama, free_port(), tmp / "logs", "--api-key", KEY), log, {})
    try:
        yield proc, _wait_ready(proc, log).groups()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def test_children_get_secrets_by_environment_only(launched: tuple) -> None:
    proc, (proxy, prefill, _decode) = launched
    family = list(_descendants(proc.pid))
    lines = {pid: _cmdline(pid) for pid in family}
    assert len(lines) >= 5, lines
    assert not [line for line in lines.values() if KEY in line or "--api-key" in line], lines
    servers = [pid for pid, line in lines.items() if " serve " in line]
    secrets = {_environ(pid).get(SECRET_ENV) for pid in servers}
    assert len(servers) == 2 and len(secrets) == 1 and None not in secrets, servers
    secret = secrets.pop()
    assert len(secret) >= 32 and not [line for line in lines.values() if secret in line]
    proxies = [pid for pid, line in lines.items() if " proxy " in line]
    assert proxies and all(SECRET_ENV not in _environ(pid) for pid in proxies)
    assert all(_environ(pid).get(API_KEY_ENV) == KEY for pid in servers + proxies)
    # the key is required, and the proxy has it
    body = {"model": "tiny", "prompt": "the cat sees a small bird", "max_tokens": 4, "temperature": 0}
    assert httpx.post(proxy + "/v1/completions", json=body, timeout=60).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    resp = httpx.post(proxy + "/v1/completions", json=body, headers=auth, timeout=60)
    assert resp.status_code == 200, resp.text
    # the prefill's side channel: a raw client without the secret gets nothing
    line = next(lines[pid] for pid in servers if '"producer"' in lines[pid])
    config = json.loads(line.split("--kv-transfer-config ", 1)[1].strip())  # the last argument
    extra = config["kv_connector_extra_config"]
    raw = RawClient(extra["side_channel_host"], extra["side_channel_port"])
    try:
        assert isinstance(raw.ask(Handshake(1), None), Refused)
    finally:
        raw.close()


def test_api_key_sources(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    assert resolve_api_key(None, str(key_file), {}) == KEY
    assert resolve_api_key(None, None, {API_KEY_ENV: KEY}) == KEY
    assert resolve_api_key("flag", None, {API_KEY_ENV: KEY}) == "flag"
    assert resolve_api_key(None, None, {}) is None
    with pytest.raises(ConfigError, match="not both"):
        resolve_api_key("flag", str(key_file), {})
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_api_key(None, str(tmp_path / "missing"), {})


def test_serve_with_an_api_key_refuses_an_unauthenticated_side_channel(
    tiny_llama: Path, tmp_path: Path
) -> None:
    kv = json.dumps(nixl("producer"))
    args = ["serve", str(tiny_llama), "--port", str(free_port()), "--kv-transfer-config", kv]
    proc = _launch(args, tmp_path / "serve.log", {API_KEY_ENV: KEY})
    assert proc.wait(120) == 2
    log = (tmp_path / "serve.log").read_text()
    assert "side channel would be unauthenticated" in log and KEY not in log


def test_secrets_per_child(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvferry.entrypoints import disagg
    from tests.test_disagg import _parse

    monkeypatch.setenv(SECRET_ENV, "launcher-secret-0123456789")
    args = _parse(["--api-key", KEY])
    assert disagg.instance_secrets(args, {}) == {API_KEY_ENV: KEY, SECRET_ENV: "launcher-secret-0123456789"}
    assert disagg.instance_secrets(args, {"secret_file": "/etc/kv"}) == {API_KEY_ENV: KEY}
    assert SECRET_ENV not in disagg.child_environment({API_KEY_ENV: KEY})  # the proxy's
    monkeypatch.delenv(SECRET_ENV)
    fresh = {disagg.instance_secrets(_parse([]), {})[SECRET_ENV] for _ in range(2)}
    assert len(fresh) == 2 and all(len(s) == 64 for s in fresh)
    assert SECRET_ENV not in disagg.instance_secrets(_parse(["--kv-connector", "none"]), {})


def test_serving_side_channel_host_and_secret(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvferry.connector.nixl.serving import for_serving
    from kvferry.entrypoints.cli import build_parser
    from kvferry.entrypoints.engine_args import engine_config_from_args

    monkeypatch.delenv(SECRET_ENV, raising=False)

    def config(**extra):
        kv = json.dumps(nixl("producer", **extra))
        return engine_config_from_args(
            build_parser().parse_args(["serve", str(tiny_llama), "--kv-transfer-config", kv])
        )

    def extra_of(cfg) -> dict:
        return cfg.kv_transfer.kv_connector_extra_config

    assert extra_of(for_serving(config(), "10.1.2.3", None, False))["side_channel_host"] == "10.1.2.3"
    for wildcard in ("0.0.0.0", "::"):
        assert "side_channel_host" not in extra_of(for_serving(config(), wildcard, None, False))
    assert extra_of(for_serving(config(side_channel_host="10.9.9.9"), "10.1.2.3", None, False)) == {
        "side_channel_host": "10.9.9.9"
    }
    with pytest.raises(ConfigError, match="would be unauthenticated"):
        for_serving(config(), "127.0.0.1", None, True)
    secret = tmp_path / "secret"
    secret.write_text("a-long-enough-side-channel-secret")
    assert extra_of(for_serving(config(), "127.0.0.1", str(secret), True))["secret_file"] == str(secret)
    monkeypatch.setenv(SECRET_ENV, "a-long-enough-side-channel-secret")
    for_serving(config(), "127.0.0.1", None, True)  # the variable will do
    plain = engine_config_from_args(build_parser().parse_args(["serve", str(tiny_llama)]))
    assert for_serving(plain, "127.0.0.1", None, True) is plain
    with pytest.raises(ConfigError, match="needs the NixlConnector"):
        for_serving(plain, "127.0.0.1", str(secret), False)
