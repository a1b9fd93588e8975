"""``kvferry bench pd --link RATE[,DELAY]``: each instance on a host of its own, over a shaped link.

Every instance runs in a network namespace of its own (kvferry_bench.netns), its link to
the bridge shaped to RATE and DELAY (``tc``: a token bucket, or netem with a delay, on what each host sends); the proxy and the benchmark's
client stay in the root namespace. The NIXL agents are held to TCP on that link (on one
machine UCX would otherwise move the KV through shared memory, past it). Deployments:

- ``colocated``: one ``kvferry serve`` on the cores a prefill instance gets, so that its
  time to first token differs from P/D's by the transfer (and the decoder's first step);
- ``pd``: a prefill and a decode instance (a core share each), whole-request transfer;
- ``pd-layerwise``: the same with a layer-wise prefiller (the decoder reads each layer as
  the prefill computes the next ones).

After each P/D deployment the decoder's connector counters (bytes read, READs, seconds
spent reading, layers read before their prefill finished) are added to its run. Needs
root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvferry.connector.nixl.auth import SECRET_ENV
from kvferry.entrypoints.disagg import Child, spawn, split_cores, stop_all, wait_healthy
from kvferry.entrypoints.proxy_secret import PROXY_SECRET_ENV
from kvferry.ports import free_port
from kvferry.worker.cpu_placement import available_cores, format_core_list
from kvferry_bench import serve
from kvferry_bench.netns import Hosts, rate_bits, unavailable
from kvferry_bench.results import save_json

logger = logging.getLogger(__name__)

CLI = [sys.executable, "-m", "kvferry.entrypoints.cli"]
PORT = 8000  # every instance's HTTP port, on its own host
SIDE_CHANNEL_PORT = 5600
COUNTER_PREFIX = "kvferry:kv_connector_nixl_"


@dataclass(frozen=True)
class Link:
    rate: str  # tc's units: 1gbit, 10gbit
    delay: str | None  # tc's units: 50us, 1ms (netem: not every kernel has it)

    @classmethod
    def parse(cls, raw: str) -> Link:
        rate, _, delay = raw.partition(",")
        try:
            rate_bits(rate)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"--link wants RATE[,DELAY] (e.g. 1gbit or 1gbit,100us): {exc}"
            ) from exc
        return cls(rate, delay or None)

    def __str__(self) -> str:
        return self.rate + (f", {self.delay} delay" if self.delay else "")


def check_can_run() -> None:
    why = unavailable()
    if why is not None:
        raise SystemExit(f"kvferry bench pd --link: {why} (network namespaces and tc)")


def _hosts(names: list[str], link: Link) -> Hosts:
    hosts = Hosts(f"kvb{os.getpid() % 10000}", names, net=233)
    hosts.create()
    try:
        for name in names:
            hosts.shape(name, link.rate, link.delay)
    except BaseException:
        hosts.destroy()
        raise
    return hosts


def _serve(
    args: argparse.Namespace, hosts: Hosts, name: str, cores: tuple[int, ...] | None, kv: dict | None
) -> list[str]:
    cmd = (
        hosts.exec_prefix(name) + CLI + ["serve", args.model, "--host", hosts.addr(name), "--port", str(PORT)]
    )
    cmd += ["--served-model-name", "kvferry-bench", *shlex.split(args.engine_args)]
    cmd += ["--cpu-cores", format_core_list(cores)] if cores else []
    return cmd + (["--kv-transfer-config", json.dumps(kv)] if kv else [])


def _nixl(role: str, hosts: Hosts, name: str, layerwise: bool) -> dict:
    extra: dict = {}
    if role == "producer":  # its side channel on its own host
        extra = {"side_channel_host": hosts.addr(name), "side_channel_port": SIDE_CHANNEL_PORT}
        extra |= {"layerwise": True} if layerwise else {}
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": extra}


def _instance(
    args: argparse.Namespace,
    hosts: Hosts,
    host: str,
    cores: tuple[int, ...] | None,
    kv: dict | None,
    log: Path,
    env: dict[str, str],
) -> Child:
    """A `kvferry serve` on emulated host `host`."""
    url = f"http://{hosts.addr(host)}:{PORT}"
    return Child(host, _serve(args, hosts, host, cores, kv), url, log, env)


def _children(args: argparse.Namespace, name: str, hosts: Hosts, log_dir: Path) -> list[Child]:
    prefill_cores, decode_cores = split_cores([1, 1], available_cores())
    env = {
        SECRET_ENV: secrets.token_hex(32),
        PROXY_SECRET_ENV: secrets.token_hex(32),
        "UCX_TLS": "tcp",
        "UCX_NET_DEVICES": "eth0",
    }
    if name == "colocated":
        return [_instance(args, hosts, "colocated", prefill_cores, None, log_dir / "colocated.log", env)]
    producer = _nixl("producer", hosts, "prefill", name == "pd-layerwise")
    prefill = _instance(args, hosts, "prefill", prefill_cores, producer, log_dir / f"{name}-prefill.log", env)
    consumer = _nixl("consumer", hosts, "decode", False)
    decode = _instance(args, hosts, "decode", decode_cores, consumer, log_dir / f"{name}-decode.log", env)
    port = free_port()
    proxy_cmd = CLI + ["proxy", "--prefill", prefill.url, "--decode", decode.url, "--port", str(port)]
    proxy_env = {PROXY_SECRET_ENV: env[PROXY_SECRET_ENV]}
    proxy = Child("proxy", proxy_cmd, f"http://127.0.0.1:{port}", log_dir / f"{name}-proxy.log", proxy_env)
    return [prefill, decode, proxy]


def connector_counters(url: str) -> dict[str, float]:
    """The instance's NIXL counters (kvferry:kv_connector_nixl_*), by short name."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(COUNTER_PREFIX) and "_created" not in line:
            key, _, value = line.rpartition(" ")
            out[key.split("{")[0].removeprefix(COUNTER_PREFIX).removesuffix("_total")] = float(value)
    return out


def bench_deployment(args: argparse.Namespace, name: str, log_dir: Path, serve_args) -> dict:
    """Start deployment `name` on shaped hosts, benchmark it, stop it; the merged results."""
    link: Link = args.link
    names = ["colocated"] if name == "colocated" else ["prefill", "decode"]
    hosts = _hosts(names, link)
    children = _children(args, name, hosts, log_dir)
    try:
        for child in children:
            spawn(child)
        begin = time.monotonic()
        wait_healthy(children, begin + args.startup_timeout, threading.Event())
        logger.info("%s ready on a %s link in %.0f s; benchmarking", name, link, time.monotonic() - begin)
        front = children[-1]  # the proxy, or the colocated server
        command = front.cmd[len(hosts.exec_prefix("colocated")) :] if name == "colocated" else front.cmd
        decoder = None if name == "colocated" else children[1]
        before = connector_counters(decoder.url) if decoder else {}
        serve.run(serve_args(args, name, front.url, command))
        extras: dict = {"link": str(link)}
        if decoder is not None:
            after = connector_counters(decoder.url)
            extras["kv_transfer"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
        doc = _with_run_extras(args.output, name, extras)
        return doc
    finally:
        stop_all(children, grace=30.0)
        hosts.destroy()


def _with_run_extras(output: str, label: str, extras: dict) -> dict:
    """The results file with `extras` added to the run labelled `label`."""
    path = Path(output)
    doc = json.loads(path.read_text())
    for run in doc["runs"]:
        if run.get("label") == label:
            run.update(extras)
    save_json(doc, path)
    return doc
