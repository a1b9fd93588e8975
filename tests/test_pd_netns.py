"""P/D across hosts, emulated: prefill, decode and proxy each in its own network namespace
(a veth pair into a bridge, an address of its own), KV moving over NIXL/UCX between them.

Greedy answers through the proxy equal a colocated engine's, with the prompt's KV read
over the network (the decoder's NIXL bytes grow; UCX is held to TCP, so the bytes cross
the veth links). Then the prefiller's link is cut (``ip link set down``):

- after its prefill and before the decoder reads: the decoder (policy recompute) cannot
  read the KV, computes the prompt itself and still answers the same text;
- during the decoder's READ (the link shaped with ``tc`` so that the READ lasts seconds,
  the cut made once the decoder counts the READ started): the READ stalls, the decoder
  gives it up at ``transfer_timeout_s``, recomputes and answers the same text; the
  prefiller's lease, neither extended nor acknowledged, expires.

Each time the link is restored, both block pools end all free and nothing hangs; after
the mid-transfer cut, KV moves over the network again.

Needs root, ``ip netns`` and ``tc``; skips cleanly where namespaces (or a shaped link)
cannot be created (CI).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams
from tests.pd_support import ROOT, Server, nixl, stop, wait_healthy, wait_idle

# slow: P/D across network namespaces (servers and a proxy) (make test-all only)
pytestmark = pytest.mark.slow

TAG = f"kvf{os.getpid() % 100000}"
BRIDGE = f"{TAG}br"
SUBNET = "10.231.{}.{}"
HOSTS = {"prefill": 2, "decode": 3, "proxy": 4}
SUFFIX = {"prefill": "p", "decode": "d", "proxy": "x"}
PORT = 8000
MAX_TOKENS = 12
PROMPTS = ["the cat sees a small bird", "a dog sees the red ball in the morning"]
WORDS = "morning the in ball red the sees dog a bird small a sees cat the".split()
LONG = " ".join(WORDS[i % len(WORDS)] for i in range(900))  # ~900 tokens, ~0.7 MB of KV, cached nowhere
TRANSFER_TIMEOUT_S = 8.0
FAST = {"handshake_timeout_s": 2.0, "ack_timeout_s": 2.0, "transfer_timeout_s": TRANSFER_TIMEOUT_S}
RECOVERY_S = 60.0  # TCP retransmission backoff after the ~10 s outage is far less
SLOW_LINK = ["rate", "2mbit", "burst", "16kb", "latency", "2s"]  # the shaped READ takes ~3 s


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _ns(name: str) -> str:
    return f"{TAG}{SUFFIX[name]}"


def _veth(name: str) -> str:
    return f"{TAG}{SUFFIX[name]}v"


def _addr(name: str) -> str:
    return SUBNET.format(os.getpid() % 200 + 20, HOSTS[name])


def _create() -> None:
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{SUBNET.format(os.getpid() % 200 + 20, 1)}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for name in HOSTS:
        ns, veth = _ns(name), _veth(name)
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", BRIDGE, "up")
        _ip("-n", ns, "addr", "add", f"{_addr(name)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def _destroy() -> None:
    for name in HOSTS:
        subprocess.run(["ip", "netns", "del", _ns(name)], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", _veth(name)], capture_output=True, timeout=20)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, timeout=20)


@pytest.fixture(scope="module")
def namespaces() -> Iterator[None]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    try:
        _create()
    except OSError as exc:
        _destroy()
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        yield
    finally:
        _destroy()


def _start(name: str, args: list[str], log_dir: Path) -> Server:
    cmd = ["ip", "netns", "exec", _ns(name), sys.executable, "-m", "kvferry.entrypoints.cli"]
    cmd += ["--log-level", "WARNING", *args, "--host", _addr(name), "--port", str(PORT)]
    log = log_dir / f"{name}.log"
    # TCP only: on one host UCX would otherwise move the KV through shared memory (CMA),
    # past the namespaces' links.
    env = dict(os.environ, PYTHONPATH=str(ROOT), UCX_NET_DEVICES="eth0", UCX_TLS="tcp")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    return Server(name, proc, f"http://{_addr(name)}:{PORT}", log)


def _serve(model: Path, kv: dict) -> list[str]:
    return [
        "serve",
        str(model),
        "--served-model-name",
        "tiny",
        "--kv-cache-memory",
        "0.005",
        "--enforce-eager",
        "--kv-transfer-config",
        json.dumps(kv),
    ]


@pytest.fixture(scope="module")
def servers(namespaces: None, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("pd_netns")
    started = {
        "prefill": _start(
            "prefill", _serve(tiny_llama, nixl("producer", lease_s=3.0, unknown_grace_s=1.0)), logs
        ),
        "decode": _start("decode", _serve(tiny_llama, nixl("consumer", "recompute", **FAST)), logs),
    }
    proxy_args = ["proxy", "--prefill", started["prefill"].url, "--decode", started["decode"].url]
    started["proxy"] = _start("proxy", [*proxy_args, "--health-interval", "0.5"], logs)
    try:
        wait_healthy(list(started.values()))
        yield started
    finally:
        stop(list(started.values()))


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> dict[str, str]:
    llm = LLM(str(tiny_llama), kv_cache_bytes=5 << 20, enforce_eager=True)
    outs = llm.generate([*PROMPTS, LONG], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return {p: o.outputs[0].text for p, o in zip([*PROMPTS, LONG], outs, strict=True)}


def _complete(server: Server, body: dict) -> dict:
    resp = server.post({"max_tokens": MAX_TOKENS, "temperature": 0, **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_pd_across_namespaces_reads_kv_over_the_network(servers: dict, reference: dict) -> None:
    before = servers["decode"].metrics().get("kv_connector_nixl_bytes_read", 0.0)
    for prompt in PROMPTS:
        assert _complete(servers["proxy"], {"prompt": prompt})["choices"][0]["text"] == reference[prompt]
    assert servers["decode"].metrics()["kv_connector_nixl_bytes_read"] > before
    wait_idle(servers["decode"])
    wait_idle(servers["prefill"])


def test_link_cut_before_the_read_recomputes_and_frees_both_sides(servers: dict, reference: dict) -> None:
    prompt = PROMPTS[1]
    params = _complete(
        servers["prefill"],
        {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )["kv_transfer_params"]
    failed_before = servers["decode"].metrics().get("kv_connector_nixl_failed_transfers", 0.0)
    box: dict = {}
    _ip("link", "set", _veth("prefill"), "down")
    try:
        worker = threading.Thread(
            target=lambda: box.update(
                r=_complete(servers["decode"], {"prompt": prompt, "kv_transfer_params": params})
            ),
            daemon=True,
        )
        worker.start()
        worker.join(60)
        assert not worker.is_alive(), "the decoder hung on a cut link"
    finally:
        _ip("link", "set", _veth("prefill"), "up")
    assert box["r"]["choices"][0]["text"] == reference[prompt]
    assert servers["decode"].metrics()["kv_connector_nixl_failed_transfers"] > failed_before
    wait_idle(servers["decode"])
    wait_idle(servers["prefill"], timeout=30)


def _tc(name: str, *args: str) -> None:
    cmd = ["ip", "netns", "exec", _ns(name), "tc", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise OSError(f"tc {' '.join(args)}: {done.stderr.strip()}")


def _grew(server: Server, name: str, before: dict[str, float]) -> bool:
    return server.metrics().get(name, 0.0) > before.get(name, 0.0)


def _wait_grown(server: Server, name: str, before: dict[str, float], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not _grew(server, name, before):
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.name}: {name} did not grow within {timeout} s:\n{server.tail()}")
        time.sleep(0.05)


def _pd(servers: dict, prompt: str) -> str:
    """Prefill on the prefiller, then decode on the decoder (no proxy): the answer's text."""
    leg = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = _complete(servers["prefill"], leg)["kv_transfer_params"]
    return _complete(servers["decode"], {"prompt": prompt, "kv_transfer_params": params})["choices"][0][
        "text"
    ]


def _wait_reads_again(servers: dict, prompt: str, expected: str, timeout: float) -> None:
    """P/D requests until one reads its KV over the network again; each answers right.

    The first after an outage may not: what the decoder sent while the link was down
    (lease heartbeats) waits in its side-channel connection for TCP's next retransmission,
    which backs off exponentially, and the Check behind it times out (recompute)."""
    deadline = time.monotonic() + timeout
    decode = servers["decode"]
    while True:
        before = decode.metrics()
        assert _pd(servers, prompt) == expected
        if _grew(decode, "kv_connector_nixl_bytes_read", before):
            return
        assert time.monotonic() < deadline, (
            f"no KV read over the network {timeout} s after the link came back"
        )


def test_link_cut_mid_transfer_times_out_recomputes_and_recovers(servers: dict, reference: dict) -> None:
    """The prefiller's link is shaped (so the READ of ~0.7 MB takes seconds), the decoder's
    READ starts (its transfer counter grows), the link goes down: the READ stalls, the
    decoder gives it up at transfer_timeout_s and recomputes; the prefiller's lease, never
    extended nor acknowledged, expires. Link restored: both pools end free and the next
    prompt's KV moves over the network again."""
    prefill, decode = servers["prefill"], servers["decode"]
    _wait_reads_again(servers, PROMPTS[0], reference[PROMPTS[0]], RECOVERY_S)  # after an earlier cut
    leg = {"prompt": LONG, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = _complete(prefill, leg)["kv_transfer_params"]
    before, prefill_before = decode.metrics(), prefill.metrics()
    box: dict = {}
    worker = threading.Thread(
        target=lambda: box.update(r=_complete(decode, {"prompt": LONG, "kv_transfer_params": params})),
        daemon=True,
    )
    try:
        _tc("prefill", "qdisc", "add", "dev", "eth0", "root", "tbf", *SLOW_LINK)
    except (OSError, FileNotFoundError) as exc:
        pytest.skip(f"cannot shape the prefiller's link: {exc}")
    try:
        worker.start()
        _wait_grown(decode, "kv_connector_nixl_transfers", before, 30)
        _ip("link", "set", _veth("prefill"), "down")
        assert not _grew(decode, "kv_connector_nixl_bytes_read", before), "the READ ended before the cut"
        _wait_grown(decode, "kv_connector_nixl_failed_transfers", before, TRANSFER_TIMEOUT_S + 30)
        assert not _grew(decode, "kv_connector_nixl_bytes_read", before)
    finally:
        _ip("link", "set", _veth("prefill"), "up")
        _tc("prefill", "qdisc", "del", "dev", "eth0", "root")
    worker.join(60)
    assert not worker.is_alive(), "the decoder hung after the link came back"
    assert box["r"]["choices"][0]["text"] == reference[LONG]
    assert _grew(prefill, "kv_connector_nixl_expired_leases", prefill_before)
    wait_idle(decode)
    wait_idle(prefill, timeout=30)
    _wait_reads_again(servers, PROMPTS[0], reference[PROMPTS[0]], RECOVERY_S)
    wait_idle(decode)
    wait_idle(prefill)
