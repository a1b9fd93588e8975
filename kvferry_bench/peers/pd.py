"""P/D part of ``kvferry bench peers``: vLLM's own P/D beside ``kvferry disagg``, same load.

Each engine runs one prefill and one decode instance, pinned as ``kvferry disagg`` pins
them (``disagg.split_cores``: the first half of the cores prefills, the second decodes):

- vLLM: two ``vllm serve`` with its NixlConnector (``kv_both``, ``kv_buffer_device`` cpu,
  a side-channel port each), fronted by ``kvferry proxy``, which speaks vLLM's protocol:
  the prefill leg asks ``{"do_remote_decode": true}`` with ``max_tokens`` 1, the decode
  leg gets the prefill answer's ``kv_transfer_params`` as they are. vLLM's params carry no
  first token, its decoder samples the first token again (recomputing the last prompt
  token in a step of its own), and in bf16 that token is not always the prefiller's: the
  proxy streams no prefill token early for such a decoder (pd.decoder_repeats_first_token),
  and runs with ``--no-early-first-token`` besides, so the two engines' TTFT mean the same
  thing whatever the proxy's rule. vLLM's NIXL worker
  moves its process's main thread to the last core of each NUMA node (cores it keeps for
  KV transfer, read from /sys, not from the process's affinity), which takes it off the
  instance's cores: every thread found outside them once the instance is up is put back
  (``repin``), and what was moved is recorded.
- kvferry: ``kvferry disagg --prefill 1 --decode 1`` (its own proxy).

Before the load, one probe through vLLM's P/D (``probe_vllm``): the decoder's metrics
must show the prompt arriving by KV transfer, not computed (else the part fails), and
the greedy answer is compared with vLLM's colocated one (the prefill instance alone,
under another cache salt so that nothing of the P/D request is reused). Then vLLM's own
client at each rate, as in the serving part.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from kvferry.entrypoints.disagg import (
    Child,
    LaunchError,
    spawn,
    split_cores,
    start,
    stop_all,
    wait_healthy,
)
from kvferry.ports import free_port
from kvferry.worker.cpu_placement import format_core_list, parse_core_list
from kvferry_bench.peers import serving
from kvferry_bench.peers.report import VLLM_TRANSFERRED
from kvferry_bench.peers.serving import SERVED_NAME, Load
from kvferry_bench.peers.setup import Setup

logger = logging.getLogger(__name__)

KV_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
STARTUP_TIMEOUT = 900.0
PROBE_TOKENS = 32
PROBE_PROMPT = "A short story about a lighthouse keeper: " + "the waves rolled against the rocks " * 40
COLOCATED_SALT = "kvferry-bench-colocated"


class PDCheckError(RuntimeError):
    """vLLM's P/D did not transfer the KV (its decoder computed the prompt itself)."""


def role_cores(cores: str) -> tuple[str, str]:
    """The cores ``kvferry disagg`` gives its prefill and its decode instance within `cores`
    (both all of them when there is one core)."""
    prefill, decode = split_cores([1, 1], parse_core_list(cores))
    if prefill is None or decode is None:
        return cores, cores
    return format_core_list(prefill), format_core_list(decode)


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "kvferry.entrypoints.cli", *argv]


def vllm_instance(setup: Setup, role: str, cores: str) -> Child:
    """`vllm serve` with the NixlConnector on `cores`, its side channel on a port of its own."""
    port, side_port = free_port(), free_port()
    cmd = serving.server_command("vllm", replace(setup, cores=cores), port)
    cmd += ["--kv-transfer-config", json.dumps(KV_CONFIG)]
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port)}
    log = setup.work_dir / f"pd-vllm-{role}.log"
    return Child(f"vllm-{role}", cmd, f"http://127.0.0.1:{port}", log, env, side_channel_port=side_port)


def proxy_child(setup: Setup, prefill: Child, decode: Child) -> Child:
    port = free_port()
    cmd = _cli("proxy", "--prefill", prefill.url, "--decode", decode.url, "--port", str(port))
    cmd.append("--no-early-first-token")  # vLLM's decoder samples the first token again
    return Child(
        "vllm-proxy", [*setup.pin, *cmd], f"http://127.0.0.1:{port}", setup.work_dir / "pd-vllm-proxy.log"
    )


def disagg_child(setup: Setup) -> Child:
    """`kvferry disagg` (1 prefill + 1 decode + its proxy) on the setup's cores and limits."""
    port = free_port()
    cmd = _cli("disagg", str(setup.model_dir.absolute()), "--prefill", "1", "--decode", "1")
    cmd += ["--port", str(port), "--log-dir", str(setup.work_dir / "pd-kvferry-logs")]
    cmd += ["--startup-timeout", f"{STARTUP_TIMEOUT:g}", "--served-model-name", SERVED_NAME]
    cmd += ["--dtype", setup.dtype, "--max-model-len", str(setup.max_model_len)]
    cmd += ["--max-num-seqs", str(setup.max_num_seqs), "--seed", str(setup.seed)]
    cmd += setup.kvferry_engine_args()
    url = f"http://127.0.0.1:{port}"
    held = setup.kvferry_env_argv()
    return Child("kvferry-disagg", [*held, *setup.pin, *cmd], url, setup.work_dir / "pd-kvferry.log")


# ---- pinning ----------------------------------------------------------------------------


def group_threads(leader: int) -> list[tuple[int, int]]:
    """(pid, tid) of every thread of every process in `leader`'s process group."""
    threads = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != leader:
                continue
            threads += [(int(entry.name), int(task.name)) for task in (entry / "task").iterdir()]
        except OSError:  # gone meanwhile
            continue
    return threads


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def repin(leader: int, cores: str, apply: bool = True) -> list[dict]:
    """Threads of `leader`'s process group allowed on a core outside `cores`, each put back
    on `cores` (unless `apply` is false: then only listed)."""
    allowed_cores = set(parse_core_list(cores))
    moved = []
    for pid, tid in group_threads(leader):
        try:
            allowed = os.sched_getaffinity(tid)
            if allowed <= allowed_cores:
                continue
            if apply:
                os.sched_setaffinity(tid, allowed_cores)
        except OSError:
            continue
        moved.append(
            {"pid": pid, "tid": tid, "thread": _comm(pid, tid), "was": format_core_list(sorted(allowed))}
        )
    return moved


# ---- the transfer probe -------------------------------------------------------------------


def prompt_token_sources(metrics: str) -> dict[str, float]:
    """vLLM's ``prompt_tokens_by_source_total`` counters from a /metrics text, by source."""
    sources: dict[str, float] = {}
    for line in metrics.splitlines():
        if not line.startswith("vllm:prompt_tokens_by_source_total{"):
            continue
        labels, _, value = line.rpartition(" ")
        source = labels.split('source="', 1)[1].split('"', 1)[0] if 'source="' in labels else "?"
        sources[source] = sources.get(source, 0.0) + float(value)
    return sources


def _complete(url: str, body: dict, timeout: float) -> dict:
    import httpx

    resp = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    if resp.status_code != 200:
        raise RuntimeError(f"{url} answered HTTP {resp.status_code}: {resp.text[:500]}")
    return resp.json()


def _decoder_sources(url: str) -> dict[str, float]:
    import httpx

    return prompt_token_sources(httpx.get(url + "/metrics", timeout=10.0).text)


def common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def probe_vllm(prefill: Child, decode: Child, proxy: Child, timeout: float) -> dict:
    """One greedy request through vLLM's P/D: how its decoder got the prompt (by source),
    and its answer beside vLLM's colocated answer (the prefill instance alone)."""
    body = {"model": SERVED_NAME, "prompt": PROBE_PROMPT, "max_tokens": PROBE_TOKENS}
    body |= {"temperature": 0, "ignore_eos": True}
    before = _decoder_sources(decode.url)
    pd_answer = _complete(proxy.url, body, timeout)
    after = _decoder_sources(decode.url)
    colocated = _complete(prefill.url, {**body, "cache_salt": COLOCATED_SALT}, timeout)
    pd_text, colocated_text = pd_answer["choices"][0]["text"], colocated["choices"][0]["text"]
    return {
        "prompt_tokens": pd_answer["usage"]["prompt_tokens"],
        "decoder_prompt_tokens": {k: v - before.get(k, 0.0) for k, v in after.items()},
        "pd_text": pd_text,
        "colocated_text": colocated_text,
        "identical": pd_text == colocated_text,
        "common_prefix_chars": common_prefix(pd_text, colocated_text),
    }


def check_transferred(probe: dict) -> None:
    """Raise unless vLLM's decoder got the probe's prompt by KV transfer."""
    got = probe["decoder_prompt_tokens"].get(VLLM_TRANSFERRED, 0.0)
    if got <= 0:
        raise PDCheckError(
            f"vLLM's decoder received no prompt token by KV transfer (by source: "
            f"{probe['decoder_prompt_tokens']}): it recomputed the prompt, so this is not P/D"
        )


# ---- the two deployments -------------------------------------------------------------------


def run_client(setup: Setup, url: str, load: Load, rate_index: int, tag: str) -> dict:
    """serving.run_client, with the host's 1-minute load average before and after (the two
    instances account for about 2: more is other work on the machine)."""
    before = os.getloadavg()[0]
    result = serving.run_client(setup, url, load, rate_index, tag)
    return result | {"loadavg_1m": [round(before, 2), round(os.getloadavg()[0], 2)]}


def bench_vllm(setup: Setup, load: Load) -> tuple[list[dict], dict]:
    """vLLM's P/D behind kvferry's proxy: per-rate results and what was checked."""
    prefill_cores, decode_cores = role_cores(setup.cores)
    prefill = vllm_instance(setup, "prefill", prefill_cores)
    decode = vllm_instance(setup, "decode", decode_cores)
    proxy = proxy_child(setup, prefill, decode)
    cores = {prefill.name: prefill_cores, decode.name: decode_cores}
    try:
        begin = time.monotonic()
        start([prefill, decode], proxy, STARTUP_TIMEOUT, threading.Event())
        logger.info("vLLM P/D ready in %.0f s", time.monotonic() - begin)
        repinned = {c.name: repin(c.proc.pid, cores[c.name]) for c in (prefill, decode) if c.proc}
        probe = probe_vllm(prefill, decode, proxy, setup.timeout)
        check_transferred(probe)
        results = [run_client(setup, proxy.url, load, i, "pd-vllm") for i in range(len(load.rates))]
        strays = {c.name: repin(c.proc.pid, cores[c.name], apply=False) for c in (prefill, decode) if c.proc}
    finally:
        stop_all([proxy, prefill, decode], grace=30.0)
    return results, {"probe": probe, "repinned": repinned, "off_cores_after_load": strays}


DISAGG_READY = "kvferry disagg: proxy ready at"


def wait_disagg(child: Child, deadline: float) -> None:
    """Until `kvferry disagg` says it is ready (its proxy answers /health a moment before;
    a disagg stopped before its line is one stopped while starting)."""
    wait_healthy([child], deadline, threading.Event())
    while DISAGG_READY not in child.log.read_text(errors="replace"):
        if child.proc is not None and child.proc.poll() is not None:
            raise LaunchError(f"kvferry disagg exited with {child.proc.returncode}:\n{child.log_tail()}")
        if time.monotonic() > deadline:
            raise LaunchError(f"kvferry disagg did not say it was ready:\n{child.log_tail()}")
        time.sleep(0.2)


def bench_kvferry(setup: Setup, load: Load) -> tuple[list[dict], dict]:
    """`kvferry disagg`: per-rate results."""
    child = disagg_child(setup)
    spawn(child)
    try:
        begin = time.monotonic()
        wait_disagg(child, begin + STARTUP_TIMEOUT)
        logger.info("kvferry disagg ready in %.0f s", time.monotonic() - begin)
        results = [run_client(setup, child.url, load, i, "pd-kvferry") for i in range(len(load.rates))]
    finally:
        stop_all([child], grace=60.0)  # disagg stops its instances and proxy itself
    return results, {"logs": str(setup.work_dir / "pd-kvferry-logs")}


def bench_pd(engine: str, setup: Setup, load: Load) -> tuple[list[dict], dict]:
    return bench_vllm(setup, load) if engine == "vllm" else bench_kvferry(setup, load)
