"""Secrets never on a command line: `kvferry disagg` hands the API key, the KV side
channel's secret and the proxy's credential to its children by environment, and limits its
decoders to its prefillers (allowed_remotes); `kvferry serve` takes the key from a file or
$KVFERRY_API_KEY and refuses P/D with an API key but no side-channel secret or no proxy
secret (the program's main() run in this process: exit code 2, the key never printed).
kv_transfer_params from a client holding only the API key are refused (403)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.connector.nixl.auth import SECRET_ENV
from kvferry.connector.nixl.protocol import Handshake, Refused
from kvferry.engine.core_proc import CORE_PROCESS_NAME
from kvferry.entrypoints.http_common import API_KEY_ENV, resolve_api_key
from kvferry.entrypoints.proxy_secret import PROXY_SECRET_ENV, load_proxy_secret
from kvferry.errors import ConfigError
from tests import plain_http
from tests.pd_support import nixl
from tests.proxy_fakes import ROOT, free_port
from tests.test_disagg import _descendants, _disagg_args, _wait_ready
from tests.test_side_channel_auth import RawClient

# slow: starts a `kvferry disagg` deployment (make test-all only)
pytestmark = pytest.mark.slow

KEY = "sk-disagg-" + "7" * 24


def _launch(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvferry.entrypoints.cli", *args]
    full = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, SECRET_ENV, PROXY_SECRET_ENV)}
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


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def test_children_get_secrets_by_environment_only(launched: tuple) -> None:
    proc, (proxy, prefill, decode) = launched
    family = list(_descendants(proc.pid))
    lines = {pid: _cmdline(pid) for pid in family}
    assert len(lines) >= 5, lines
    assert not [line for line in lines.values() if KEY in line or "--api-key" in line], lines
    servers = [pid for pid, line in lines.items() if " serve " in line and _comm(pid) != CORE_PROCESS_NAME]
    secrets = {_environ(pid).get(SECRET_ENV) for pid in servers}
    assert len(servers) == 2 and len(secrets) == 1 and None not in secrets, servers
    secret = secrets.pop()
    assert len(secret) >= 32 and not [line for line in lines.values() if secret in line]
    proxies = [pid for pid, line in lines.items() if " proxy " in line]
    assert proxies and all(SECRET_ENV not in _environ(pid) for pid in proxies)
    assert all(_environ(pid).get(API_KEY_ENV) == KEY for pid in servers + proxies)
    proxy_secrets = {_environ(pid).get(PROXY_SECRET_ENV) for pid in servers + proxies}
    assert len(proxy_secrets) == 1 and None not in proxy_secrets
    proxy_secret = proxy_secrets.pop()
    assert len(proxy_secret) >= 32 and not [line for line in lines.values() if proxy_secret in line]
    # the key is required, and the proxy has it
    body = {"model": "tiny", "prompt": "the cat sees a small bird", "max_tokens": 4, "temperature": 0}
    assert plain_http.post(proxy + "/v1/completions", json=body, timeout=60).status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    resp = plain_http.post(proxy + "/v1/completions", json=body, headers=auth, timeout=60)
    assert resp.status_code == 200, resp.text
    # kv_transfer_params straight from a client with the API key: refused, by either role
    forged = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
    }
    for url, params in ((prefill, {"do_remote_decode": True}), (decode, forged)):
        refused = plain_http.post(
            url + "/v1/completions", json={**body, "kv_transfer_params": params}, headers=auth, timeout=60
        )
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["param"] == "kv_transfer_params"
    # the prefill's side channel: a raw client without the secret gets nothing; the decoder
    # dials only it
    configs = {
        '"producer"' in lines[pid]: json.loads(lines[pid].split("--kv-transfer-config ", 1)[1].strip())
        for pid in servers
    }
    extra = configs[True]["kv_connector_extra_config"]
    allowed = configs[False]["kv_connector_extra_config"]["allowed_remotes"]
    assert allowed == [f"{extra['side_channel_host']}:{extra['side_channel_port']}"]
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


def _refused_serve(
    tiny_llama: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys, caplog
) -> str:
    """`kvferry serve` with a producer NIXL connector, run through the program's main() in
    this process with `env` as its only secrets: it must stop with exit code 2 before the
    server starts. Returns what it printed (stdout, stderr and its log records)."""
    from kvferry.entrypoints.cli import main
    from kvferry.entrypoints.openai import server

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("kvferry serve started a server it should have refused")

    monkeypatch.setattr(server, "run_server", started)
    for name in (API_KEY_ENV, SECRET_ENV, PROXY_SECRET_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    kv = json.dumps(nixl("producer"))
    with caplog.at_level(logging.DEBUG), pytest.raises(SystemExit) as stopped:
        main(["serve", str(tiny_llama), "--port", str(free_port()), "--kv-transfer-config", kv])
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert err.startswith("kvferry: error: "), err
    return out + err + caplog.text


def test_serve_with_an_api_key_refuses_an_unauthenticated_side_channel(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, capsys, caplog
) -> None:
    printed = _refused_serve(tiny_llama, {API_KEY_ENV: KEY}, monkeypatch, capsys, caplog)
    assert "side channel would be unauthenticated" in printed and KEY not in printed


def test_serve_with_an_api_key_and_a_connector_needs_a_proxy_secret(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, capsys, caplog
) -> None:
    printed = _refused_serve(
        tiny_llama, {API_KEY_ENV: KEY, SECRET_ENV: "s" * 32}, monkeypatch, capsys, caplog
    )
    assert "no proxy secret" in printed and KEY not in printed


def test_proxy_secret_sources(tmp_path: Path) -> None:
    path = tmp_path / "proxy-secret"
    path.write_text("from-a-file-0123456789\n")
    env = {PROXY_SECRET_ENV: "from-the-env-0123456789"}
    assert load_proxy_secret(str(path), env) == "from-a-file-0123456789"
    assert load_proxy_secret(None, env) == "from-the-env-0123456789"
    assert load_proxy_secret(None, {}) is None
    with pytest.raises(ConfigError, match="shorter"):
        load_proxy_secret(None, {PROXY_SECRET_ENV: "short"})


def test_decoders_dial_only_the_prefillers_started_with_them(tmp_path: Path) -> None:
    from kvferry.entrypoints import disagg
    from tests.test_disagg import _parse

    args = _parse(["--prefill", "2", "--decode", "2", "--cpu-split", "none"])
    children = disagg.plan_instances(args, {}, tmp_path)
    configs = {c.name: json.loads(c.cmd[c.cmd.index("--kv-transfer-config") + 1]) for c in children}
    ports = [c.side_channel_port for c in children if c.name.startswith("prefill")]
    for name in ("decode-0", "decode-1"):
        assert configs[name]["kv_connector_extra_config"]["allowed_remotes"] == [
            f"127.0.0.1:{p}" for p in ports
        ]
    assert "allowed_remotes" not in configs["prefill-0"]["kv_connector_extra_config"]
    own = disagg.plan_instances(args, {"allowed_remotes": ["10.0.0.9"]}, tmp_path)
    assert all("10.0.0.9" in " ".join(c.cmd) for c in own)  # an allow-list given is kept


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
    monkeypatch.setenv(PROXY_SECRET_ENV, "launcher-proxy-secret-0123456789")
    shared = disagg.deployment_secrets(args)
    assert shared == {API_KEY_ENV: KEY, PROXY_SECRET_ENV: "launcher-proxy-secret-0123456789"}
    assert disagg.instance_secrets(args, {}, shared)[PROXY_SECRET_ENV] == shared[PROXY_SECRET_ENV]
    monkeypatch.delenv(PROXY_SECRET_ENV)
    assert len({disagg.deployment_secrets(args)[PROXY_SECRET_ENV] for _ in range(2)}) == 2


def test_serving_side_channel_host_and_secret(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvferry.entrypoints.cli import build_parser, serve_config

    monkeypatch.delenv(SECRET_ENV, raising=False)

    def served(host: str, *args: str, kv: dict | None = None) -> dict:
        """The settled extra config of `kvferry serve --host HOST ARGS`."""
        argv = ["serve", str(tiny_llama), "--host", host, *args]
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        config = serve_config(build_parser().parse_args(argv))
        return config.kv_transfer.kv_connector_extra_config

    # (a consumer: a producer would also pick a free side-channel port on that host)
    assert served("10.1.2.3", kv=nixl("consumer"))["side_channel_host"] == "10.1.2.3"
    for wildcard in ("0.0.0.0", "::"):
        assert "side_channel_host" not in served(wildcard, kv=nixl("producer"))
    assert served("10.1.2.3", kv=nixl("consumer", side_channel_host="10.9.9.9"))["side_channel_host"] == (
        "10.9.9.9"
    )
    with pytest.raises(ConfigError, match="would be unauthenticated"):
        served("127.0.0.1", "--api-key", KEY, kv=nixl("producer"))
    secret = tmp_path / "secret"
    secret.write_text("a-long-enough-side-channel-secret")
    with_secret = served(
        "127.0.0.1", "--api-key", KEY, "--kv-transfer-secret-file", str(secret), kv=nixl("producer")
    )
    assert with_secret["secret_file"] == str(secret)
    monkeypatch.setenv(SECRET_ENV, "a-long-enough-side-channel-secret")
    served("127.0.0.1", "--api-key", KEY, kv=nixl("producer"))  # the variable will do
    assert served("127.0.0.1", "--api-key", KEY, kv=None) == {}
    with pytest.raises(ConfigError, match="needs a KV connector that takes a secret"):
        served("127.0.0.1", "--kv-transfer-secret-file", str(secret))
    offload = {"kv_connector": "OffloadConnector"}
    with pytest.raises(ConfigError, match="needs a KV connector that takes a secret"):
        served("127.0.0.1", "--kv-transfer-secret-file", str(secret), kv=offload)
    # inside a MultiConnector, the NixlConnector settles its side channel the same way
    multi = {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {"connectors": [nixl("consumer")]},
    }
    argv = ["serve", str(tiny_llama), "--host", "10.1.2.3", "--kv-transfer-config", json.dumps(multi)]
    spec = serve_config(
        build_parser().parse_args([*argv, "--kv-transfer-secret-file", str(secret)])
    ).connector
    assert (
        spec is not None
        and spec.children[0].transfer.kv_connector_extra_config["side_channel_host"] == "10.1.2.3"
    )
