"""xPyD started by hand, as on separate hosts: two prefillers, two decoders and the proxy,
each `kvferry serve` / `kvferry proxy` in a network namespace of its own (kvferry_bench.netns),
with the commands docs/fleet.md gives: fixed side-channel ports, the decoders' allow-list,
KV events on wildcard TCP endpoints, `kvferry proxy --policy prefix` following them.

Greedy answers through the proxy equal a colocated engine's; the KV crosses the links
(NIXL over UCX held to TCP); the proxy learns both prefillers' blocks over the network and
sends a prompt that extends a cached prefix to the prefiller holding it; every instance
serves; every block pool is full again. Skips where namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams
from kvferry_bench.netns import Hosts, unavailable
from tests.pd_support import ROOT, Server, stop, wait_healthy
from tests.test_disagg import _wait_blocks_free
from tests.test_fleet import PROMPTS, upstream_counts
from tests.test_prefix_routing import answer, known_blocks, prefix_stats

pytestmark = pytest.mark.slow  # five processes across namespaces (make test-all only)

HOSTS = Hosts(f"kvfl{os.getpid() % 10000}", ["prefill-0", "prefill-1", "decode-0", "decode-1", "proxy"])
PREFILLS, DECODES = ["prefill-0", "prefill-1"], ["decode-0", "decode-1"]
HTTP_PORT, SIDE_PORT, EVENTS_PORT, REPLAY_PORT = 8000, 5600, 5557, 5558


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    if (why := unavailable()) is not None:
        pytest.skip(why)
    try:
        HOSTS.create()
    except OSError as exc:
        HOSTS.destroy()
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        yield HOSTS
    finally:
        HOSTS.destroy()


def instance_args(model: Path, hosts: Hosts, name: str) -> list[str]:
    """`kvferry serve` as docs/fleet.md starts an instance by hand on host ``name``."""
    if name in PREFILLS:
        extra: dict = {"side_channel_port": SIDE_PORT}
    else:
        extra = {"allowed_remotes": [f"{hosts.addr(p)}:{SIDE_PORT}" for p in PREFILLS]}
    kv = {"kv_connector": "NixlConnector", "kv_role": "producer" if name in PREFILLS else "consumer"}
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{EVENTS_PORT}",
        "replay_endpoint": f"tcp://*:{REPLAY_PORT}",
    }
    args = ["serve", str(model), "--served-model-name", "tiny", "--kv-cache-memory", "0.005"]
    args += ["--enforce-eager", "--block-size", "4"]
    args += ["--kv-transfer-config", json.dumps({**kv, "kv_connector_extra_config": extra})]
    return args + ["--kv-events-config", json.dumps(events)]


def proxy_args(model: Path, hosts: Hosts) -> list[str]:
    def urls(names: list[str]) -> list[str]:
        return [f"http://{hosts.addr(n)}:{HTTP_PORT}" for n in names]

    def events(names: list[str]) -> list[str]:
        return [f"tcp://{hosts.addr(n)}:{EVENTS_PORT},tcp://{hosts.addr(n)}:{REPLAY_PORT}" for n in names]

    args = ["proxy", "--prefill", *urls(PREFILLS), "--decode", *urls(DECODES), "--policy", "prefix"]
    args += ["--tokenizer", str(model), "--block-size", "4", "--health-interval", "0.5"]
    return args + ["--prefill-kv-events", *events(PREFILLS), "--decode-kv-events", *events(DECODES)]


def start(hosts: Hosts, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> Server:
    cmd = [*hosts.exec_prefix(name), sys.executable, "-m", "kvferry.entrypoints.cli", "--log-level", "INFO"]
    cmd += [*args, "--host", hosts.addr(name), "--port", str(HTTP_PORT)]
    log = log_dir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    return Server(name, proc, f"http://{hosts.addr(name)}:{HTTP_PORT}", log)


def test_instances_started_by_hand_on_four_hosts_serve_behind_the_proxy(
    hosts: Hosts, tiny_llama: Path, tmp_path: Path
) -> None:
    # the same secrets everywhere, by environment; UCX on TCP so the KV crosses the links
    env = dict(os.environ, PYTHONPATH=str(ROOT), UCX_NET_DEVICES="eth0", UCX_TLS="tcp")
    env |= {"KVFERRY_KV_SECRET": secrets.token_hex(32), "KVFERRY_PROXY_SECRET": secrets.token_hex(32)}
    servers = [
        start(hosts, n, instance_args(tiny_llama, hosts, n), env, tmp_path) for n in PREFILLS + DECODES
    ]
    try:
        llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20, enforce_eager=True, block_size=4)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
        expected = {p: o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}
        wait_healthy(servers)
        servers.append(start(hosts, "proxy", proxy_args(tiny_llama, hosts), env, tmp_path))
        wait_healthy(servers[-1:])
        proxy, urls = servers[-1].url, {s.name: s.url for s in servers[:-1]}
        deadline = time.monotonic() + 120
        for i, prompt in enumerate(PROMPTS):
            assert answer(proxy, prompt, stream=i % 2 == 1) == expected[prompt], prompt
            while i == 1 and min(known_blocks(proxy, urls[p]) for p in PREFILLS) == 0:
                assert time.monotonic() < deadline, "the proxy never learned the prefillers' blocks"
                time.sleep(0.1)
        for name in PREFILLS + DECODES:
            assert prefix_stats(urls[name])[0] > 0, f"{name} computed no prompt"
        assert set(upstream_counts(proxy, "decode")) == {urls[d] for d in DECODES}
        assert sum(prefix_stats(urls[p])[1] for p in PREFILLS) > 0  # second questions hit their prefix
        read = sum(servers[i + 2].metrics().get("kv_connector_nixl_bytes_read", 0.0) for i in range(2))
        assert read > 0  # the KV crossed the links
        for name in PREFILLS + DECODES:
            _wait_blocks_free(urls[name])
    finally:
        stop(servers)
