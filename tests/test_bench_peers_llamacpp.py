"""llama.cpp in `kvferry bench peers` without building llama.cpp: its venv installed once
(with fake pip and python), its driver's greedy loop and result document (with a fake
``llama_cpp`` module), the workloads file and commands it gets, its server's command, the
report's llama.cpp columns and token agreement, and the offline part's plumbing with a
fake driver run. The checks that run the real llama.cpp skip when its venv is absent (CI
never builds it)."""

from __future__ import annotations

import json
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.cpu_features import IsaCap
from kvferry.errors import KVFerryError
from kvferry_bench.peers import (
    command,
    llamacpp_driver,
    llamacpp_install,
    llamacpp_server,
    offline,
    report,
    run,
    serving,
)
from kvferry_bench.peers.offline import OfflineShape
from tests.test_bench_peers import _driver_doc, peers_args, peers_setup
from tests.test_bench_peers_pd import _fake_venv

REPO = Path(__file__).resolve().parents[1]
LLAMACPP_VENV = Path(os.environ.get("KVFERRY_LLAMACPP_VENV", REPO / ".venv-llamacpp"))
needs_llamacpp = pytest.mark.skipif(
    not llamacpp_install.is_ready(LLAMACPP_VENV), reason=f"no llama.cpp venv at {LLAMACPP_VENV}"
)


def test_llamacpp_is_an_engine_with_its_own_venv() -> None:
    args = peers_args("--engines", "llamacpp,kvferry", "--llamacpp-venv", "/tmp/ll")
    assert args.engines == ["llamacpp", "kvferry"] and args.llamacpp_venv == "/tmp/ll"
    defaults = peers_args()
    assert defaults.engines == ["kvferry", "vllm", "llamacpp"] and defaults.llamacpp_venv is None
    assert llamacpp_install.default_venv(None) == Path(".venv-llamacpp")
    assert "llamacpp" not in command.PD_ENGINES


def test_llamacpp_venv_is_built_once_and_checked(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    calls = _fake_venv(venv, 0)
    python = llamacpp_install.ensure_llamacpp(venv)
    assert python == venv / "bin" / "python"
    pip, check = calls.read_text().splitlines()
    assert pip.split() == ["pip", "install", "-q", "llama-cpp-python[server]==0.3.36"]
    assert check.startswith("python -c import llama_cpp, llama_cpp.server.app") and "0.3.36" in check
    assert llamacpp_install.is_ready(venv)
    llamacpp_install.ensure_llamacpp(venv)  # ready: nothing runs again
    assert len(calls.read_text().splitlines()) == 2


def test_a_failed_llamacpp_build_is_a_clear_error(tmp_path: Path) -> None:
    calls = _fake_venv(tmp_path / "venv", 1)
    with pytest.raises(llamacpp_install.LlamaCppInstallError, match=r"llama-cpp-python.*kvferry-install.log"):
        llamacpp_install.ensure_llamacpp(tmp_path / "venv")
    assert len(calls.read_text().splitlines()) == 1  # not checked after a failed build
    assert not llamacpp_install.is_ready(tmp_path / "venv")


def test_a_llamacpp_held_to_avx2_is_built_for_it_in_its_own_venv(tmp_path: Path) -> None:
    """--max-isa avx2: GGML's options for AVX2 alone (not the CPU's own), no wheel cache (it
    would hand back the native build), and a check that refuses AVX-512 in the library."""
    venv = tmp_path / "venv"
    calls = _fake_venv(venv, 0)
    llamacpp_install.ensure_llamacpp(venv, IsaCap.AVX2)
    pip, check = calls.read_text().splitlines()
    assert pip.split() == ["pip", "install", "-q", "llama-cpp-python[server]==0.3.36", "--no-cache-dir"]
    args = llamacpp_install.cmake_args(IsaCap.AVX2).split()
    assert args[0] == "-DGGML_NATIVE=OFF" and "-DGGML_AVX2=ON" in args and "-DGGML_FMA=ON" in args
    assert "-DGGML_AVX512=OFF" in args and "-DGGML_AVX512_VNNI=OFF" in args and "-DGGML_AMX_INT8=OFF" in args
    assert "-DGGML_AVX512=ON" in llamacpp_install.cmake_args(IsaCap.AVX512).split()
    assert llamacpp_install.default_venv(IsaCap.AVX2) == Path(".venv-llamacpp-avx2")
    assert "AVX512" in check and "for avx2" in (venv / llamacpp_install.READY).read_text()
    tail = llamacpp_install.check_code(IsaCap.AVX2).removeprefix(llamacpp_install.CHECK)
    for info, held in ((b"CPU : AVX2 = 1 | FMA = 1 | ", True), (b"CPU : AVX2 = 1 | AVX512 = 1 | ", False)):
        fake = types.SimpleNamespace(llama_print_system_info=lambda info=info: info)
        if held:
            exec(tail, {"llama_cpp": fake})
        else:
            with pytest.raises(AssertionError):
                exec(tail, {"llama_cpp": fake})


def test_a_held_kvferry_runs_under_the_cap_and_vllm_is_refused(tmp_path: Path) -> None:
    from dataclasses import replace

    setup = replace(peers_setup(tmp_path), isa_cap=IsaCap.AVX2)
    held = ["env", "ATEN_CPU_CAPABILITY=avx2", "KVFERRY_MAX_ISA=avx2", "ONEDNN_MAX_CPU_ISA=AVX2"]
    cmd, _ = offline.driver_command("kvferry", tmp_path / "w.json", tmp_path / "o.json", setup)
    assert cmd[:4] == held and cmd[4] == sys.executable
    assert serving.server_command("kvferry", setup, 8125)[:4] == held
    plain, _ = offline.driver_command(
        "kvferry", tmp_path / "w.json", tmp_path / "o.json", peers_setup(tmp_path)
    )
    assert plain[0] == sys.executable
    args = peers_args("--max-isa", "avx2", "--engines", "kvferry,vllm")
    with pytest.raises(KVFerryError, match="vLLM"):
        run.run_peers(args)


class FakeLlama:
    """llama_cpp.Llama's surface the driver uses: tokens 100, 101, ... after any prompt."""

    instances: list[FakeLlama] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        FakeLlama.instances.append(self)

    def reset(self) -> None:
        self.calls.append(("reset",))

    def generate(self, tokens, temp: float, repeat_penalty: float, reset: bool) -> Iterator[int]:
        self.calls.append(("generate", list(tokens), temp, repeat_penalty, reset))
        token = 100
        while True:
            yield token
            token += 1


@pytest.fixture
def fake_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> type[FakeLlama]:
    module = types.ModuleType("llama_cpp")
    module.Llama = FakeLlama  # type: ignore[attr-defined]
    module.__version__ = "0.3.36"  # type: ignore[attr-defined]
    module.llama_print_system_info = lambda: b"CPU : AVX2 = 1 | "  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    FakeLlama.instances = []
    return FakeLlama


def _spec(tmp_path: Path) -> Path:
    workloads = [
        {"name": "throughput", "prompts": [[1, 2], [3, 4]], "warmup": [[5, 6], [7, 8]], "max_tokens": 6},
        {"name": "decode_b1", "prompts": [[9, 10, 11]], "warmup": [[12, 13, 14]], "max_tokens": 10},
        {"name": "prefill", "prompts": [[15] * 20], "warmup": [[16] * 20], "max_tokens": 1},
    ]
    spec = {"gguf_file": "/m/model.gguf", "threads": 3, "max_model_len": 4096, "seed": 7}
    path = tmp_path / "workloads.json"
    path.write_text(json.dumps({**spec, "workloads": workloads}))
    return path


def test_llamacpp_driver_times_batch1_workloads_greedy_from_an_empty_cache(
    fake_llama_cpp: type[FakeLlama], tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    llamacpp_driver.main(str(_spec(tmp_path)), str(out))
    (llm,) = fake_llama_cpp.instances
    assert llm.kwargs["model_path"] == "/m/model.gguf" and llm.kwargs["n_ctx"] == 4096
    assert llm.kwargs["n_threads"] == llm.kwargs["n_threads_batch"] == 3 and llm.kwargs["n_batch"] == 2048
    generates = [call for call in llm.calls if call[0] == "generate"]
    # warm-up then timed prompt per batch-1 workload; every one greedy, after a reset
    assert [call[1] for call in generates] == [[12, 13, 14], [9, 10, 11], [16] * 20, [15] * 20]
    assert all(call[2:] == (0.0, 1.0, False) for call in generates)
    assert [call[0] for call in llm.calls] == ["reset", "generate"] * 4

    doc = json.loads(out.read_text())
    assert doc["engine"] == "llamacpp" and doc["threads"] == 3 and "AVX2" in doc["system_info"]
    assert set(doc["workloads"]) == {"decode_b1", "prefill"} and set(doc["skipped"]) == {"throughput"}
    decode = doc["workloads"]["decode_b1"]
    assert decode["tokens"] == list(range(100, 110)) and decode["generated_tokens"] == 10
    assert decode["prompt_tokens"] == 3 and decode["first_tokens"] == [list(range(100, 108))]
    assert 0 <= decode["first_token_s"] <= decode["seconds"]
    assert doc["workloads"]["prefill"]["generated_tokens"] == 1


def test_workloads_file_and_driver_command_give_llamacpp_the_gguf_and_the_cores(tmp_path: Path) -> None:
    from dataclasses import replace

    gguf = tmp_path / "m.gguf"
    setup = replace(peers_setup(tmp_path), cores="0,2,4", llamacpp_venv=tmp_path / "ll", gguf_file=gguf)
    spec = json.loads(offline.write_spec(setup, []).read_text())
    assert spec["gguf_file"] == str(gguf.absolute()) and spec["threads"] == 3

    cmd, env = offline.driver_command("llamacpp", tmp_path / "w.json", tmp_path / "o.json", setup)
    assert cmd == [str(tmp_path / "ll/bin/python"), str(offline.LLAMACPP_DRIVER), str(tmp_path / "w.json"),
                   str(tmp_path / "o.json")] and env is None  # fmt: skip
    with pytest.raises(offline.DriverError, match="not a GGUF model"):
        offline.driver_command(
            "llamacpp", tmp_path / "w.json", tmp_path / "o.json", replace(setup, gguf_file=None)
        )

    server = serving.server_command("llamacpp", setup, 8125)
    assert server[:5] == [
        "taskset",
        "-c",
        "0,2,4",
        str(tmp_path / "ll/bin/python"),
        str(serving.LLAMACPP_SERVER),
    ]
    flags = dict(zip(server, server[1:]))
    assert flags["--model"] == str(gguf.absolute()) and flags["--model_alias"] == serving.SERVED_NAME
    assert flags["--port"] == "8125" and flags["--n_ctx"] == "2048" and flags["--n_threads"] == "3"
    assert flags["--n_threads_batch"] == "3" and flags["--interrupt_requests"] == "False"


def test_llamacpp_server_never_sees_the_clients_request_id() -> None:
    import asyncio

    seen: list[dict] = []

    async def app(scope, receive, send) -> None:
        seen.append(scope)

    wrapped = llamacpp_server.without_request_id(app)
    headers = [(b"x-request-id", b"bench-1f-3"), (b"content-type", b"application/json")]
    asyncio.run(wrapped({"type": "http", "headers": headers}, None, None))
    asyncio.run(wrapped({"type": "lifespan"}, None, None))
    assert seen == [
        {"type": "http", "headers": [(b"content-type", b"application/json")]},
        {"type": "lifespan"},
    ]


def test_llamacpp_server_launcher_wraps_the_app_and_sends_no_pings(monkeypatch: pytest.MonkeyPatch) -> None:
    server = types.ModuleType("llama_cpp.server.__main__")
    sse = types.ModuleType("sse_starlette.sse")
    sse.EventSourceResponse = type("EventSourceResponse", (), {"DEFAULT_PING_INTERVAL": 15})  # type: ignore[attr-defined]
    apps: list[object] = []

    def fake_main() -> None:
        apps.append(server.create_app(server_settings=None, model_settings=[]))  # type: ignore[attr-defined]

    server.create_app = lambda **settings: "app"  # type: ignore[attr-defined]
    server.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp.server.__main__", server)
    monkeypatch.setitem(sys.modules, "sse_starlette.sse", sse)
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    monkeypatch.setitem(sys.modules, "llama_cpp.server", types.ModuleType("llama_cpp.server"))
    monkeypatch.setitem(sys.modules, "sse_starlette", types.ModuleType("sse_starlette"))
    llamacpp_server.main()
    assert sse.EventSourceResponse.DEFAULT_PING_INTERVAL == llamacpp_server.NO_PING_S >= 10**6  # type: ignore[attr-defined]
    (app,) = apps
    assert callable(app) and app != "app"  # the server's app behind the header filter


def test_report_puts_llamacpp_beside_vllm_with_its_own_ratio() -> None:
    shape = vars(OfflineShape())
    k = _driver_doc({"throughput": 4.0, "decode_b1": 4.0, "prefill": 0.5})
    v = _driver_doc({"throughput": 8.0, "decode_b1": 8.0, "prefill": 1.0})
    ll = _driver_doc({"decode_b1": 2.0, "prefill": 0.495}, load_s=1.0)
    rows = report.offline_rows({"kvferry": k, "vllm": v, "llamacpp": ll}, shape)
    tp, decode, ms, prefill, load = rows
    assert tp.llamacpp is None and tp.ratio_to(report.Peer.LLAMACPP) is None and tp.ahead == "kvferry"
    assert decode.llamacpp == 64.0 and decode.ratio_to(report.Peer.LLAMACPP) == 0.5
    assert decode.ahead_of(report.Peer.LLAMACPP) == "llama.cpp" and decode.ahead == "kvferry"
    assert ms.unit == "ms/token" and ms.kvferry == 1000 * 4.0 / 128 and ms.llamacpp == 1000 * 2.0 / 128
    assert ms.ahead_of(report.Peer.LLAMACPP) == "llama.cpp" and not ms.higher_is_better
    assert prefill.ahead_of(report.Peer.LLAMACPP) == "even" and load.llamacpp == 1.0
    assert decode.as_dict()["ratio_llamacpp"] == 0.5 and decode.as_dict()["ahead_llamacpp"] == "llama.cpp"

    header = report.format_table(rows).splitlines()[0].split()
    assert header == ["part", "metric", "unit", "kvferry", "vLLM", "llama.cpp", "kvferry/vLLM", "ahead",
                      "kvferry/llama.cpp", "ahead"]  # fmt: skip
    without = report.offline_rows({"kvferry": k, "vllm": v}, shape)
    assert "llama.cpp" not in report.format_table(without)  # the two-engine table as it was

    srows = report.serving_rows({"llamacpp": [{"request_rate": 0.1, "output_throughput": 5.0}]})
    assert srows[0].llamacpp == 5.0 and srows[0].kvferry is None and srows[0].vllm is None


def test_token_agreement_counts_the_identical_prefix() -> None:
    def doc(**tokens: list[int]) -> dict:
        return {"workloads": {name: {"tokens": t} for name, t in tokens.items()}}

    offline_doc = {
        "kvferry": doc(decode_b1=[1, 2, 3, 4, 5], prefill=[9], throughput=[7]),
        "llamacpp": doc(decode_b1=[1, 2, 3, 8, 5], prefill=[9]),
    }
    agreement = report.token_agreement(offline_doc, "llamacpp")
    assert agreement == {
        "decode_b1": {"identical_prefix": 3, "compared": 5},
        "prefill": {"identical_prefix": 1, "compared": 1},
    }
    assert report.token_agreement({"kvferry": offline_doc["kvferry"]}, "llamacpp") is None
    line = report.agreement_summary(agreement, "float32")
    assert "decode_b1: first 3 of 5 identical" in line and "(float32)" in line


def test_offline_part_runs_every_engine_and_reports_llamacpp_agreement(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dataclasses import replace

    ran: list[str] = []

    def fake_run_offline(engine: str, spec: Path, setup) -> dict:
        ran.append(engine)
        if engine == "vllm":
            raise offline.DriverError("vllm exited with 1")
        doc = _driver_doc({"decode_b1": 2.0, "prefill": 0.5})
        tokens = [5, 6, 7, 8] if engine == "kvferry" else [5, 6, 0, 8]
        doc["workloads"]["decode_b1"]["tokens"] = tokens
        return doc

    monkeypatch.setattr(offline, "run_offline", fake_run_offline)
    setup = replace(peers_setup(tmp_path), model_dir=tiny_llama, gguf_file=tmp_path / "m.gguf")
    part = run.offline_part(setup, ["kvferry", "vllm", "llamacpp"], OfflineShape(2, 8, 4, 4, 20))
    assert ran == ["kvferry", "vllm", "llamacpp"] and part["vllm"] == {"error": "vllm exited with 1"}
    assert part["llamacpp_agreement"] == {"decode_b1": {"identical_prefix": 2, "compared": 4}}
    assert part["same_first_tokens"] is None  # vLLM has no run to compare

    doc = {"model": "m", "dtype": "float32", "cores": "0-1", "engines": ["kvferry", "llamacpp"],
           "work_dir": str(tmp_path), "offline": {**part, "shape": vars(OfflineShape(2, 8, 4, 4, 20))}}  # fmt: skip
    run.finish(doc, tmp_path / "peers.json")
    saved = json.loads((tmp_path / "peers.json").read_text())
    (decode,) = [
        r for r in saved["comparison"] if r["metric"].startswith("batch-1") and r["unit"] == "gen tok/s"
    ]
    assert decode["llamacpp"] == decode["kvferry"] == 64.0 and decode["ahead_llamacpp"] == "even"
    printed = capsys.readouterr().out
    assert "llama.cpp" in printed.splitlines()[0] and "decode_b1: first 2 of 4 identical" in printed


@needs_llamacpp
@pytest.mark.slow  # loads the 135M GGUF in llama.cpp
def test_real_llamacpp_driver_runs_the_embedded_gguf(smollm2_gguf: Path, tmp_path: Path) -> None:
    import subprocess

    spec = json.loads(_spec(tmp_path).read_text()) | {"gguf_file": str(smollm2_gguf), "threads": 2}
    (tmp_path / "real.json").write_text(json.dumps(spec))
    out = tmp_path / "out.json"
    command = [str(LLAMACPP_VENV / "bin/python"), str(offline.LLAMACPP_DRIVER), str(tmp_path / "real.json")]
    subprocess.run([*command, str(out)], check=True, timeout=600)
    doc = json.loads(out.read_text())
    assert doc["version"] == llamacpp_install.VERSION and "CPU" in doc["system_info"]
    decode = doc["workloads"]["decode_b1"]
    assert decode["generated_tokens"] == 10 and len(decode["tokens"]) == 10  # no stop at EOS
    assert doc["workloads"]["prefill"]["generated_tokens"] == 1 and doc["skipped"].keys() == {"throughput"}
