"""`kvferry bench peers` without vLLM: argument parsing, the embedded model converted to an
HF directory (loadable by transformers, same logits as kvferry's own GGUF loading), the
parsing of `vllm bench serve` result JSON, the report's ratios, the server and client
commands, and the kvferry side of the offline part end to end on the tiny model. The
checks that need vLLM's venv skip when it is absent (CI never installs it)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvferry_bench.cli import build_parser
from kvferry_bench.peers import command, report, serving
from kvferry_bench.peers.install import add_vllm_metadata, is_ready, vllm_env
from kvferry_bench.peers.offline import OfflineShape, make_workloads
from kvferry_bench.peers.setup import Setup

REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = Path(os.environ.get("KVFERRY_VLLM_VENV", REPO / ".venv-vllm"))
needs_vllm = pytest.mark.skipif(not is_ready(VLLM_VENV), reason=f"no vLLM venv at {VLLM_VENV}")

# One `vllm bench serve --save-result` document as vLLM 0.32 writes it (its keys; trimmed).
VLLM_RESULT = {
    "date": "20261123-223000",
    "endpoint_type": "openai",
    "backend": "openai",
    "label": None,
    "model_id": "peers-bench",
    "tokenizer_id": "/models/smollm2",
    "num_prompts": 4,
    "request_rate": "inf",
    "burstiness": 1.0,
    "max_concurrency": None,
    "duration": 8.0,
    "completed": 4,
    "failed": 0,
    "total_input_tokens": 400,
    "total_output_tokens": 32,
    "request_throughput": 0.5,
    "request_goodput": None,
    "output_throughput": 4.0,
    "total_token_throughput": 54.0,
    "max_output_tokens_per_s": 6.0,
    "max_concurrent_requests": 4,
    "mean_ttft_ms": 1200.0,
    "median_ttft_ms": 1100.0,
    "std_ttft_ms": 90.0,
    "p50_ttft_ms": 1100.0,
    "p99_ttft_ms": 1500.0,
    "mean_tpot_ms": 80.0,
    "median_tpot_ms": 79.0,
    "std_tpot_ms": 2.0,
    "p50_tpot_ms": 79.0,
    "p99_tpot_ms": 85.0,
    "mean_itl_ms": 80.0,
    "median_itl_ms": 78.0,
    "std_itl_ms": 9.0,
    "p50_itl_ms": 78.0,
    "p99_itl_ms": 120.0,
    "mean_e2el_ms": 1800.0,
    "median_e2el_ms": 1700.0,
    "std_e2el_ms": 100.0,
    "p50_e2el_ms": 1700.0,
    "p99_e2el_ms": 2000.0,
}


def peers_args(*argv: str):
    return build_parser().parse_args(["peers", *argv])


def test_arguments_parse_to_parts_engines_and_shapes() -> None:
    args = peers_args("--parts", "serve,offline", "--engines", "kvferry", "--request-rate", "0.5", "inf")
    assert args.parts == ["serve", "offline"] and args.engines == ["kvferry"]
    assert args.request_rate == [0.5, float("inf")] and args.dtype == "bfloat16"
    assert args.output == "bench-results/peers.json" and args.vllm_venv == ".venv-vllm"
    assert command.offline_shape(args) == OfflineShape(64, 32, 128, 128, 1500)
    assert command.serving_load(args) == serving.Load(1000, 64, 16, (0.5, float("inf")))
    assert command.max_model_len(OfflineShape(prefill_len=3000), serving.Load()) == 3072
    assert command.max_model_len(OfflineShape(), serving.Load()) == 2048
    for bad in (["--parts", "offline,gpu"], ["--engines", ""], ["--request-rate", "0"]):
        with pytest.raises(SystemExit):
            peers_args(*bad)


def test_workloads_are_exact_lengths_and_warmups_differ(tiny_llama: Path) -> None:
    from kvferry.model.resolve import resolve_model_config
    from kvferry.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_config(str(tiny_llama)))
    workloads = {w["name"]: w for w in make_workloads(tokenizer, OfflineShape(5, 12, 7, 9, 60))}
    assert [len(p) for p in workloads["throughput"]["prompts"]] == [12] * 5
    assert [len(p) for p in workloads["prefill"]["prompts"]] == [60]
    assert [w["max_tokens"] for w in workloads.values()] == [7, 9, 1]
    assert [len(w["warmup"]) for w in workloads.values()] == [5, 1, 1]
    for w in workloads.values():
        assert not set(map(tuple, w["prompts"])) & set(map(tuple, w["warmup"]))
    assert make_workloads(tokenizer, OfflineShape(5, 12, 7, 9, 60)) == list(workloads.values())


@pytest.mark.slow  # converts and runs the 135M SmolLM2
def test_embedded_model_converts_to_an_hf_dir_with_kvferrys_weights(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvferry.model.loader import gguf_state_dict
    from kvferry.model.resolve import resolve_model_config
    from kvferry_bench.peers.convert import hf_model_dir

    out = hf_model_dir("smollm2", "bfloat16", tmp_path)
    assert out.parent == tmp_path and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    saved = load_file(out / "model.safetensors")
    dequantized = gguf_state_dict(str(smollm2_gguf))  # what kvferry's loader computes from the GGUF
    assert set(saved) == set(dequantized) - {"lm_head.weight"}  # tied to the embedding
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, dequantized[name].to(torch.bfloat16)), (
            name
        )

    converted = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        top = converted(ids).logits[0, -1].argmax().item()
    assert tokenizer.decode([top]).strip() == "Paris"
    config = resolve_model_config(str(out), dtype="bfloat16")  # kvferry loads the same directory
    assert config.gguf_file is None and config.architecture == "LlamaForCausalLM" and config.num_kv_heads == 3

    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert hf_model_dir("smollm2", "bfloat16", tmp_path) == out  # kept: not converted again
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_an_hf_dir_model_is_used_as_it_is(tiny_llama: Path, tmp_path: Path) -> None:
    from kvferry_bench.peers.convert import hf_model_dir

    assert hf_model_dir(str(tiny_llama), "float32", tmp_path) == tiny_llama
    assert not any(tmp_path.iterdir())


def test_vllm_bench_serve_result_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    path.write_text(json.dumps(VLLM_RESULT))
    parsed = serving.parse_bench_serve(path)
    assert parsed["request_rate"] == float("inf") and parsed["completed"] == 4 and parsed["failed"] == 0
    assert parsed["output_throughput"] == 4.0 and parsed["p99_itl_ms"] == 120.0
    assert parsed["mean_ttft_ms"] == 1200.0 and parsed["median_e2el_ms"] == 1700.0
    assert set(parsed) == set(serving.KEPT_KEYS)
    path.write_text(json.dumps({**VLLM_RESULT, "request_rate": 0.25}))
    assert serving.parse_bench_serve(path)["request_rate"] == 0.25


def _driver_doc(seconds: dict[str, float], load_s: float = 10.0) -> dict:
    tokens = {"throughput": (64 * 32, 64 * 128), "decode_b1": (32, 128), "prefill": (1500, 1)}
    workloads = {
        name: {"seconds": s, "prompt_tokens": tokens[name][0], "generated_tokens": tokens[name][1]}
        for name, s in seconds.items()
    }
    return {"load_s": load_s, "workloads": workloads}


def test_report_ratios_say_who_is_ahead() -> None:
    shape = vars(OfflineShape())
    offline = {
        "kvferry": _driver_doc({"throughput": 4.0, "decode_b1": 2.0, "prefill": 0.5}, load_s=10.0),
        "vllm": _driver_doc({"throughput": 8.0, "decode_b1": 2.02, "prefill": 1.0}, load_s=40.0),
    }
    rows = {row.metric.split(" ")[0]: row for row in report.offline_rows(offline, shape)}
    assert rows["throughput"].kvferry == 64 * 128 / 4.0 and rows["throughput"].ratio == 2.0
    assert rows["throughput"].ahead == "kvferry"
    assert rows["batch-1"].ahead == "even"
    assert rows["prefill"].ratio == 0.5 and rows["prefill"].ahead == "kvferry"  # seconds: lower wins
    assert report.kvferry_speedup(rows["prefill"]) == 2.0
    assert rows["engine"].ahead == "kvferry"
    slow = report.Row("serving", "mean TTFT", "ms", 300.0, 100.0, False)
    assert slow.ratio == 3.0 and slow.ahead == "vLLM"

    serving_doc = {
        "kvferry": [{**VLLM_RESULT, "request_rate": 0.1, "output_throughput": 2.0}],
        "vllm": [{**VLLM_RESULT, "request_rate": 0.1, "output_throughput": 4.0}],
    }
    srows = report.serving_rows(serving_doc)
    assert [r.metric for r in srows][0] == "output tok/s @ 0.1 req/s"
    assert srows[0].ratio == 0.5 and srows[0].ahead == "vLLM"
    table = report.format_table([*rows.values(), *srows])
    assert "2.00x" in table and "0.50x" in table and table.splitlines()[0].split()[:2] == ["part", "metric"]


def test_report_with_one_engine_missing_has_no_ratio() -> None:
    rows = report.offline_rows({"kvferry": _driver_doc({"throughput": 4.0})}, vars(OfflineShape()))
    assert rows[0].vllm is None and rows[0].ratio is None and rows[0].ahead == "-"
    assert rows[1].kvferry is None  # no decode_b1 run
    assert " - " in report.format_table(rows)


def peers_setup(tmp_path: Path) -> Setup:
    return Setup(
        model_dir=tmp_path / "model",
        dtype="bfloat16",
        work_dir=tmp_path,
        cores="0-1",
        max_model_len=2048,
        max_num_seqs=8,
        kv_cache_gib=1.5,
        vllm_venv=tmp_path / "venv",
        kvferry_args=["--enforce-eager"],
    )


@pytest.mark.parametrize(
    ("kvferry_args", "loads_the_gguf"),
    [(["--quantization", "gguf"], True), (["--quantization=gguf", "--enforce-eager"], True),
     (["--quantization", "int4"], False), ([], False)],
)  # fmt: skip
def test_kvferry_loads_the_gguf_itself_under_gguf_quantization(
    tmp_path: Path, kvferry_args: list[str], loads_the_gguf: bool
) -> None:
    """--quantization gguf keeps the file's blocks: kvferry's server and driver get the GGUF,
    not the directory converted for vLLM (which that mode refuses)."""
    setup = replace(peers_setup(tmp_path), gguf_file=tmp_path / "m.gguf", kvferry_args=kvferry_args)
    expected = setup.gguf_file if loads_the_gguf else setup.model_dir
    assert setup.kvferry_model() == expected
    assert str(expected.absolute()) in serving.server_command("kvferry", setup, 8124)
    assert str(setup.model_dir.absolute()) in serving.server_command("vllm", setup, 8123)


def test_server_and_client_commands_share_model_cores_and_limits(tmp_path: Path) -> None:
    setup = peers_setup(tmp_path)
    vllm = serving.server_command("vllm", setup, 8123)
    kvf = serving.server_command("kvferry", setup, 8124)
    assert "VLLM_TARGET_DEVICE=cpu" in vllm and "VLLM_CPU_KVCACHE_SPACE=1.5" in vllm
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1" in vllm
    for cmd in (vllm, kvf):
        assert cmd[cmd.index("taskset") : cmd.index("taskset") + 3] == ["taskset", "-c", "0-1"]
        assert str(setup.model_dir.absolute()) in cmd and "8123" in vllm
        assert cmd[cmd.index("--max-model-len") + 1] == "2048" and cmd[cmd.index("--max-num-seqs") + 1] == "8"
        assert cmd[cmd.index("--served-model-name") + 1] == serving.SERVED_NAME
    assert vllm[vllm.index("taskset") + 3 :][:2] == [str(tmp_path / "venv/bin/vllm"), "serve"]
    assert kvf[kvf.index("serve") - 1] == "kvferry.entrypoints.cli" and "--enforce-eager" in kvf
    assert kvf[kvf.index("--kv-cache-memory") + 1] == "1.5"

    load = serving.Load(900, 32, 5, (0.25, 0.5))
    client = serving.client_command(setup, "http://127.0.0.1:8123", load, 0, tmp_path / "r.json")
    flags = dict(zip(client, client[1:]))
    second = serving.client_command(setup, "http://127.0.0.1:8124", load, 1, tmp_path / "s.json")
    second_flags = dict(zip(second, second[1:]))
    # each rate its own prompts (a rate's prompts would be cached at the next), same for both engines
    assert second_flags["--request-rate"] == "0.5" and second_flags["--seed"] != flags["--seed"]
    assert flags["--backend"] == "openai" and flags["--dataset-name"] == "random"
    assert flags["--random-input-len"] == "900" and flags["--random-output-len"] == "32"
    assert flags["--num-prompts"] == "5" and flags["--request-rate"] == "0.25"
    assert flags["--temperature"] == "0" and flags["--tokenizer"] == str(setup.model_dir.absolute())
    assert flags["--result-filename"] == "r.json" and "--ignore-eos" in client and "--save-result" in client


def test_vllm_metadata_record_makes_the_vllm_distribution_visible(tmp_path: Path) -> None:
    assert not [d for d in importlib.metadata.distributions(path=[str(tmp_path)])]
    add_vllm_metadata(tmp_path, "0.32.0")
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])
    assert dist.metadata["Name"] == "vllm" and dist.version == "0.32.0"
    assert vllm_env({"X": "1"})["VLLM_TARGET_DEVICE"] == "cpu"


@pytest.mark.slow  # converts and runs the 135M SmolLM2
def test_kvferry_side_of_offline_runs_end_to_end(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    argv = [str(tiny_llama), "--parts", "offline", "--engines", "kvferry", "--dtype", "float32"]
    argv += ["--offline-prompts", "3", "--offline-input-len", "8", "--offline-output-len", "5"]
    argv += ["--decode-len", "6", "--prefill-len", "40", "--kv-cache-gib", "0.01", "--output", str(out)]
    argv += ["--kvferry-args=--enforce-eager"]  # what is tested is the bench, not the compiler
    args = peers_args(*argv)
    args.func(args)

    doc = json.loads(out.read_text())
    runs = doc["offline"]["kvferry"]["workloads"]
    assert runs["throughput"]["generated_tokens"] == 3 * 5 and runs["throughput"]["prompt_tokens"] == 3 * 8
    assert runs["decode_b1"]["generated_tokens"] == 6
    assert runs["prefill"]["prompt_tokens"] == 40 and runs["prefill"]["generated_tokens"] == 1
    assert "vllm" not in doc["offline"] and doc["offline"]["same_first_tokens"] is None
    assert "pd" not in doc and "serving" not in doc
    (tp,) = [row for row in doc["comparison"] if row["metric"].startswith("throughput")]
    assert tp["kvferry"] == pytest.approx(15 / runs["throughput"]["seconds"]) and tp["ratio"] is None
    assert out.with_suffix(".png").stat().st_size > 5_000
    assert (tmp_path / "peers-work" / "offline-kvferry.log").is_file()


@needs_vllm
def test_vllm_venv_answers_with_the_vllm_metadata_and_cpu_platform() -> None:
    code = "import importlib.metadata as m, os; print(m.version('vllm'), os.environ['VLLM_TARGET_DEVICE'])"
    done = subprocess.run(
        [str(VLLM_VENV / "bin/python"), "-c", code],
        capture_output=True,
        text=True,
        env=vllm_env(),
        check=True,
    )
    assert done.stdout.split() == ["0.32.0", "cpu"]
