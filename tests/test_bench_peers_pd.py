"""The P/D part of `kvferry bench peers` without vLLM: cores split as `kvferry disagg`
splits them, the vLLM instance, proxy and disagg commands (the disagg one parsed by
kvferry's own CLI), kvferry's proxy against fake instances answering as vLLM 0.32's
NixlConnector does, threads put back on their cores, the decoder's metrics read, nixl
installed once into the vLLM venv (with fake pip and python), the report's P/D rows, and
`kvferry disagg` started and stopped by the bench on the tiny model. The check that needs
vLLM's venv skips when it is absent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvferry.entrypoints import disagg
from kvferry.entrypoints.cli import build_parser
from kvferry.ports import LOWEST_PORT, ephemeral_start
from kvferry_bench.peers import install, pd, report
from kvferry_bench.peers.setup import Setup
from tests import plain_http
from tests.proxy_fakes import serve_in_thread
from tests.test_bench_peers import peers_setup

REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = Path(os.environ.get("KVFERRY_VLLM_VENV", REPO / ".venv-vllm"))

# vLLM 0.32's /metrics lines on the decoder after one P/D request (trimmed).
DECODER_METRICS = """\
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="peers-bench",source="local_compute"} 0.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="peers-bench",source="local_cache_hit"} 256.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="peers-bench",source="external_kv_transfer"} 482.0
vllm:prompt_tokens_by_source_created{engine="0",model_name="peers-bench",source="local_compute"} 1.79e+09
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="peers-bench"} 2.0
"""


@pytest.mark.parametrize("cores", [(0, 1), (0, 1, 2, 3), (2, 3, 4), (5,)])
def test_cores_are_split_as_kvferry_disagg_splits_them(cores: tuple[int, ...], monkeypatch) -> None:
    monkeypatch.setattr(disagg, "available_cores", lambda: cores)
    args = build_parser().parse_args(["disagg", "smollm2"])
    planned = disagg.plan_instances(args, {}, Path("/tmp"))
    pinned = [c.cmd[c.cmd.index("--cpu-cores") + 1] if "--cpu-cores" in c.cmd else None for c in planned]
    expected = tuple(p or ",".join(map(str, cores)) for p in pinned)  # unpinned: all cores
    assert pd.role_cores(",".join(map(str, cores))) == expected
    assert pd.role_cores("0-1") == ("0", "1") and pd.role_cores("0-3") == ("0,1", "2,3")


def _port_ok(port: int) -> bool:
    return LOWEST_PORT <= port < ephemeral_start()


def test_vllm_instances_and_their_proxy(tmp_path: Path) -> None:
    setup = peers_setup(tmp_path)
    prefill = pd.vllm_instance(setup, "prefill", "0")
    decode = pd.vllm_instance(setup, "decode", "1")
    for child, core in ((prefill, "0"), (decode, "1")):
        cmd = child.cmd
        assert cmd[cmd.index("taskset") : cmd.index("taskset") + 3] == ["taskset", "-c", core]
        assert f"VLLM_CPU_OMP_THREADS_BIND={core}" in cmd and "VLLM_CPU_KVCACHE_SPACE=1.5" in cmd
        assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) == {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
        }
        assert cmd[cmd.index("taskset") + 3 :][:2] == [str(tmp_path / "venv/bin/vllm"), "serve"]
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd[cmd.index("--max-num-seqs") + 1] == "8"
        assert child.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(child.side_channel_port)
        assert child.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    ports = [int(c.url.rsplit(":", 1)[1]) for c in (prefill, decode)]
    ports += [prefill.side_channel_port, decode.side_channel_port]
    assert len(set(ports)) == 4 and all(_port_ok(p) for p in ports)

    proxy = pd.proxy_child(setup, prefill, decode)
    flags = dict(zip(proxy.cmd, proxy.cmd[1:]))
    assert flags["--prefill"] == prefill.url and flags["--decode"] == decode.url
    assert proxy.cmd[proxy.cmd.index("kvferry.entrypoints.cli") + 1] == "proxy"
    assert proxy.url.endswith(flags["--port"]) and _port_ok(int(flags["--port"]))
    assert flags["-c"] == "0-1"  # on all the cores, as disagg's proxy
    assert "--no-early-first-token" in proxy.cmd  # vLLM's decoder samples the first token again
    args = build_parser().parse_args(proxy.cmd[proxy.cmd.index("kvferry.entrypoints.cli") + 1 :])
    assert args.early_first_token is False and args.prefill == [prefill.url]


def test_disagg_command_is_kvferrys_own_disagg_with_the_same_limits(tmp_path: Path) -> None:
    setup = peers_setup(tmp_path)
    child = pd.disagg_child(setup)
    assert child.cmd[:3] == ["taskset", "-c", "0-1"]
    argv = child.cmd[child.cmd.index("kvferry.entrypoints.cli") + 1 :]
    args = build_parser().parse_args(argv)
    assert args.prefill == 1 and args.decode == 1 and args.cpu_split == "even"
    assert args.model == str(setup.model_dir.absolute()) and child.url.endswith(f":{args.port}")
    passed = disagg.engine_argv(args)  # what every instance gets
    flags = dict(zip(passed, passed[1:]))
    assert flags["--served-model-name"] == "peers-bench" and flags["--dtype"] == "bfloat16"
    assert flags["--max-model-len"] == "2048" and flags["--max-num-seqs"] == "8"
    assert flags["--kv-cache-memory"] == "1.5" and "--enforce-eager" in passed
    assert Path(args.log_dir).parent == tmp_path


# ---- kvferry's proxy against instances answering as vLLM's NixlConnector does ----------

ANSWER = ["Hello", " big", " world"]


class VLLMLike:
    """A fake vLLM 0.32 server: a prefill request (do_remote_decode) gets one token and the
    NixlConnector's kv_transfer_params (no first_token_id); the decoder recomputes the
    first token itself, so its answer starts with it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[dict] = []
        self.app = FastAPI()
        self.app.get("/health")(self.health)
        self.app.post("/v1/completions")(self.complete)

    async def health(self) -> JSONResponse:
        return JSONResponse({})

    async def complete(self, request: Request):
        body = await request.json()
        self.requests.append(body)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            return JSONResponse(self._answer(ANSWER[0], "length") | {"kv_transfer_params": self.params()})
        if body.get("stream"):
            return StreamingResponse(self._stream(), media_type="text/event-stream")
        return JSONResponse(self._answer("".join(ANSWER), "length"))

    def params(self) -> dict:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[0, 1, 2]],
            "remote_engine_id": "engine-" + self.name,
            "remote_request_id": "cmpl-abc-0-1234abcd",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "remote_num_tokens": 300,
            "transfer_mode": "pull",
        }

    @staticmethod
    def _answer(text: str, reason: str | None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}

    async def _stream(self):
        for i, text in enumerate(ANSWER):
            reason = "length" if i == len(ANSWER) - 1 else None
            yield f"data: {json.dumps(self._answer(text, reason))}\n\n"
        usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        yield f"data: {json.dumps(self._answer('', None) | {'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"


def _streamed_text(resp: httpx.Response) -> str:
    text = ""
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            text += "".join(c.get("text") or "" for c in json.loads(line[6:]).get("choices", []))
    return text


@pytest.mark.parametrize("early", [False, True])
def test_kvferry_proxy_speaks_vllms_kv_transfer_protocol(early: bool) -> None:
    from kvferry.entrypoints.proxy.app import build_app
    from kvferry.entrypoints.proxy.config import ProxyConfig

    prefill, decode = VLLMLike("p"), VLLMLike("d")
    with serve_in_thread(prefill.app) as p_url, serve_in_thread(decode.app) as d_url:
        config = ProxyConfig(prefill_urls=(p_url,), decode_urls=(d_url,), early_first_token=early)
        proxy = build_app(config)
        with serve_in_thread(proxy) as url:
            body = {"model": "m", "prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            plain = plain_http.post(url + "/v1/completions", json=body, timeout=30)
            streamed = plain_http.post(
                url + "/v1/completions",
                json=body | {"stream": True, "stream_options": {"include_usage": True}},
                timeout=30,
            )
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == "".join(ANSWER)
    assert streamed.status_code == 200 and _streamed_text(streamed) == "".join(ANSWER)  # first token once
    assert len(prefill.requests) == 2 and len(decode.requests) == 2
    for sent in prefill.requests:
        assert sent["kv_transfer_params"] == {"do_remote_decode": True}
        assert sent["max_tokens"] == 1 and sent["stream"] is False and "stream_options" not in sent
    for sent in decode.requests:
        assert sent["kv_transfer_params"] == prefill.params()  # as vLLM's prefill gave them
        assert sent["max_tokens"] == 3 and sent["ignore_eos"] is True
    assert decode.requests[1]["stream"] is True


# ---- threads back on their cores, the decoder's metrics, nixl's install --------------------

STRAY = """
import os, threading, time
def stray():
    os.sched_setaffinity(0, {CORE})  # this thread only, as vLLM's NIXL worker does
    time.sleep(60)
threading.Thread(target=stray, name="stray").start()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_threads_off_the_instances_cores_are_put_back() -> None:
    home, away = sorted(os.sched_getaffinity(0))[:2]
    code = STRAY.replace("CORE", str(away))
    cmd = ["taskset", "-c", str(home), sys.executable, "-c", code]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        listed = pd.repin(proc.pid, str(home), apply=False)
        assert [t["was"] for t in listed] == [str(away)] and listed[0]["pid"] == proc.pid
        moved = pd.repin(proc.pid, str(home))
        assert moved == listed
        tids = [tid for _, tid in pd.group_threads(proc.pid)]
        assert len(tids) >= 2 and all(os.sched_getaffinity(t) == {home} for t in tids)
        assert pd.repin(proc.pid, str(home), apply=False) == []
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_decoder_metrics_tell_a_transfer_from_a_recompute() -> None:
    assert pd.prompt_token_sources(DECODER_METRICS) == {
        "local_compute": 0.0,
        "local_cache_hit": 256.0,
        "external_kv_transfer": 482.0,
    }
    probe = {"prompt_tokens": 369, "decoder_prompt_tokens": {"external_kv_transfer": 369.0}}
    pd.check_transferred(probe)
    recomputed = {"prompt_tokens": 369, "decoder_prompt_tokens": {"local_compute": 369.0}}
    with pytest.raises(pd.PDCheckError, match="recomputed"):
        pd.check_transferred(recomputed)
    assert pd.common_prefix("abcd", "abxd") == 2 and pd.common_prefix("ab", "abc") == 2


def _fake_venv(venv: Path, pip_status: int) -> Path:
    """bin/pip and bin/python that record their arguments (pip exits with `pip_status`)."""
    calls = venv / "calls.txt"
    (venv / "bin").mkdir(parents=True)
    for name, status in (("pip", pip_status), ("python", 0)):
        script = venv / "bin" / name
        script.write_text(
            f'#!/bin/sh\necho "{name} $*" | tr "\\n" " " >> {calls}\necho >> {calls}\nexit {status}\n'
        )
        script.chmod(0o755)
    return calls


def test_nixl_is_installed_once_without_deps_and_checked(tmp_path: Path) -> None:
    calls = _fake_venv(tmp_path / "venv", 0)
    install.ensure_nixl(tmp_path / "venv")
    pip, python = calls.read_text().splitlines()
    assert pip.split()[:4] == ["pip", "install", "-q", "--no-deps"]
    assert pip.split()[4:] == list(install.NIXL_PACKAGES) and "nixl==1.5.1" in pip
    assert python.startswith("python -c") and "torch.version.cuda" in python and "UCX" in python
    assert (tmp_path / "venv" / install.NIXL_READY).is_file()
    install.ensure_nixl(tmp_path / "venv")  # ready: nothing runs again
    assert len(calls.read_text().splitlines()) == 2


def test_a_failed_nixl_install_is_a_clear_error(tmp_path: Path) -> None:
    calls = _fake_venv(tmp_path / "venv", 1)
    with pytest.raises(install.VLLMInstallError, match=r"nixl \(needed by vLLM's P/D\).*kvferry-install.log"):
        install.ensure_nixl(tmp_path / "venv")
    assert len(calls.read_text().splitlines()) == 1  # not checked after a failed install
    assert not (tmp_path / "venv" / install.NIXL_READY).exists()


# ---- the report ---------------------------------------------------------------------------


def _result(rate: float, ttft: float, tput: float) -> dict:
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms")
    keys += ("p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")
    return {"request_rate": rate, "output_throughput": tput, **{k: ttft for k in keys}}


def test_pd_rows_summary_and_plot(tmp_path: Path) -> None:
    pd_doc = {
        "cores": {"prefill": "0", "decode": "1"},
        "kvferry": [_result(0.15, 100.0, 8.0), _result(0.3, 120.0, 9.0)],
        "vllm": [_result(0.15, 200.0, 4.0), _result(0.3, 240.0, 4.5)],
        "vllm_check": {
            "probe": {
                "prompt_tokens": 369,
                "decoder_prompt_tokens": {"external_kv_transfer": 369.0, "local_compute": 0.0},
                "pd_text": "abcdef",
                "identical": False,
                "common_prefix_chars": 4,
            },
            "repinned": {"vllm-prefill": [{"pid": 1, "tid": 1, "thread": "VLLM::Worker", "was": "1"}]},
        },
    }
    rows = report.pd_rows(pd_doc)
    assert len(rows) == 2 * len(report.PD_METRICS) and {r.part for r in rows} == {"pd"}
    by_metric = {r.metric: r for r in rows}
    assert (
        by_metric["p50 TTFT @ 0.15 req/s"].ratio == 0.5
        and by_metric["p50 TTFT @ 0.15 req/s"].ahead == "kvferry"
    )
    assert by_metric["output tok/s @ 0.3 req/s"].ratio == 2.0
    pd_doc["vllm"][1]["loadavg_1m"] = [2.5, 4.25]
    pd_doc["vllm"][0]["loadavg_1m"] = [3.0, 2.0]
    assert "p99 end-to-end @ 0.3 req/s" in by_metric and "p50 ITL @ 0.15 req/s" in by_metric
    summary = report.pd_summary(pd_doc | {"kvferry_error": "disagg died\nlog tail"})
    assert "369 of the probe's 369 prompt tokens by KV transfer (0 computed)" in summary
    assert "differs from vLLM colocated (first 4 of 6 chars agree)" in summary
    assert "vllm-prefill: 1 thread(s) had left its cores (to 1); put back" in summary
    assert "kvferry failed: disagg died" in summary and "log tail" not in summary
    assert "1-minute load average during the vllm runs: 2-4.25" in summary
    table = report.format_table(rows)
    assert "pd" in table.splitlines()[2] and "0.50x" in table
    offline = report.Row("offline", "prefill", "s", 1.0, 2.0, False)
    for name, plot_rows, pd_part in (
        ("none", [], None),
        ("pd", rows, pd_doc),
        ("both", [offline, *rows], pd_doc),
    ):
        assert report.save_plot(tmp_path / f"{name}.png", plot_rows, {}, "t", pd_part)
    heights = {name: _png_size(tmp_path / f"{name}.png")[1] for name in ("none", "pd", "both")}
    assert heights["none"] == heights["pd"] and heights["both"] == pytest.approx(2 * heights["pd"], rel=0.05)


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


# ---- kvferry disagg as the bench starts it ---------------------------------------------------


@pytest.mark.slow  # starts `kvferry disagg`: a prefill, a decode and a proxy process
def test_the_bench_runs_kvferry_disagg_and_stops_it(tiny_llama: Path, tmp_path: Path, monkeypatch) -> None:
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    setup = replace(
        peers_setup(tmp_path), cores=cores, model_dir=tiny_llama, dtype="float32", kv_cache_gib=0.01
    )
    seen: list[tuple[str, int, str]] = []

    def one_request(setup: Setup, url: str, load, rate_index: int, tag: str) -> dict:
        """Instead of vLLM's client: one greedy request through disagg's proxy."""
        body = {"model": "peers-bench", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
        answer = plain_http.post(url + "/v1/completions", json=body, timeout=120).json()
        seen.append((url, rate_index, tag))
        return {"request_rate": load.rates[rate_index], "tokens": answer["usage"]["completion_tokens"]}

    monkeypatch.setattr(pd.serving, "run_client", one_request)
    results, facts = pd.bench_pd("kvferry", setup, pd.Load(10, 4, 1, (0.5, 1.0)))
    assert [r["tokens"] for r in results] == [4, 4] and [r["request_rate"] for r in results] == [0.5, 1.0]
    assert all(len(r["loadavg_1m"]) == 2 for r in results)
    assert [(i, tag) for _, i, tag in seen] == [(0, "pd-kvferry"), (1, "pd-kvferry")]
    log = (tmp_path / "pd-kvferry.log").read_text()
    assert pd.DISAGG_READY in log and "all stopped" in log  # disagg stopped cleanly, its children too
    logs = sorted(p.name for p in Path(facts["logs"]).iterdir())
    assert logs == ["decode-0.log", "prefill-0.log", "proxy.log"]
    url = seen[0][0]
    with pytest.raises(httpx.ConnectError):
        plain_http.get(url + "/health", timeout=2)


@pytest.mark.skipif(
    not (install.is_ready(VLLM_VENV) and (VLLM_VENV / install.NIXL_READY).is_file()),
    reason=f"no vLLM venv with nixl at {VLLM_VENV}",
)
def test_vllm_venv_has_nixl_on_a_cpu_torch() -> None:
    done = subprocess.run(
        [str(VLLM_VENV / "bin/python"), "-c", install.NIXL_CHECK], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
