"""`kvferry bench goodput`: its workloads and its goodput arithmetic (fast, pure), and one
sweep of colocated serving and prefix-routed P/D on the tiny model (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvferry_bench import goodput_vllm
from kvferry_bench.cli import build_parser
from kvferry_bench.goodput_metrics import (
    PrefixCacheCounts,
    RequestTiming,
    Slo,
    attainment,
    goodput,
    num_blocks,
    percentiles_ms,
    pooled_hit_rate,
    prefill_paths,
    prefix_cache_counts,
)
from kvferry_bench.goodput_oracle import oracle_hit_rate
from kvferry_bench.goodput_workload import WorkloadKind, WorkloadSpec, make_workload, poisson_gaps

SHARED = WorkloadSpec(
    WorkloadKind.SHARED_PREFIX, 100, num_system=2, users_per_system=3, system_len=20, turn_len=5, turns=3
)


def test_shared_prefix_turns_extend_the_previous_prompt_and_share_the_system_prompt() -> None:
    requests = make_workload(SHARED, seed=1)
    assert len(requests) == 2 * 3 * 3
    assert [r.turn for r in requests] == [0] * 6 + [1] * 6 + [2] * 6  # a turn after the one it extends
    by_conversation: dict[int, list[tuple[int, ...]]] = {}
    for r in requests:
        by_conversation.setdefault(r.conversation, []).append(r.prompt)
    for prompts in by_conversation.values():
        assert [len(p) for p in prompts] == [25, 30, 35]
        assert prompts[1][:25] == prompts[0] and prompts[2][:30] == prompts[1]
    groups: dict[str, set[tuple[int, ...]]] = {}
    for r in requests:
        groups.setdefault(r.group, set()).add(r.prompt[:20])
    assert len(groups) == 2 and all(len(prefixes) == 1 for prefixes in groups.values())
    assert len({r.prompt[20:25] for r in requests if r.turn == 0}) == 6  # users differ after it
    assert all(100 <= t < 32000 for r in requests for t in r.prompt)


def test_multi_turn_conversations_extend_their_own_turns_and_share_nothing_else() -> None:
    spec = WorkloadSpec(
        WorkloadKind.MULTI_TURN, 100, num_system=2, users_per_system=2, system_len=20, turn_len=5, turns=3
    )
    requests = make_workload(spec, seed=1)
    assert len(requests) == 4 * 3 and [r.turn for r in requests] == [0] * 4 + [1] * 4 + [2] * 4
    first_turns = [r.prompt for r in requests if r.turn == 0]
    assert len({p[:1] for p in first_turns}) == 4  # every conversation opens differently
    for r in requests[4:]:
        earlier = next(e for e in requests if e.conversation == r.conversation and e.turn == r.turn - 1)
        assert r.prompt[: len(earlier.prompt)] == earlier.prompt and len(r.prompt) == len(earlier.prompt) + 5


def test_oracle_sends_each_prompt_where_its_prefix_is_and_counts_the_engines_hits() -> None:
    a, b = list(range(100, 132)), list(range(200, 232))  # two prefixes of 2 blocks of 16
    trace = [a + [1], b + [2], a + [3], b + [4], a + [5]]
    result = oracle_hit_rate(trace, num_instances=2, capacity_blocks=100, block_size=16)
    # the first a and b land on different instances (fewest requests), the rest hit 2 blocks each
    assert (result.hits, result.queries, result.requests_per_instance) == (3 * 32, 5 * 33, (3, 2))
    # the last token is never a hit: a prompt of exactly 2 blocks, seen before, hits 1 block
    assert oracle_hit_rate([a, a], 1, 100, 16).hits == 16
    # one instance that holds a single block keeps only the newest prompt's last block
    assert oracle_hit_rate([a + [1], b + [2], a + [3]], 1, 1, 16).hits == 0
    assert oracle_hit_rate([a + [1], a + [2]], 1, 2, 16).hit_rate == 32 / 66
    with pytest.raises(ValueError, match="capacity"):
        oracle_hit_rate(trace, 2, 0, 16)


def test_oracle_bounds_round_robin_on_shared_prefix_traffic() -> None:
    requests = make_workload(SHARED, seed=4)
    prompts = [r.prompt for r in requests]
    two = oracle_hit_rate(prompts, 2, 1000, 4).hit_rate
    one = oracle_hit_rate(prompts, 1, 1000, 4).hit_rate
    assert two is not None and one is not None and two == one  # with room, 2 instances lose nothing
    assert oracle_hit_rate(prompts, 2, 3, 4).hit_rate < two  # a small cache evicts prefixes


def test_workloads_are_functions_of_their_seed_and_differ_between_seeds() -> None:
    assert make_workload(SHARED, 1) == make_workload(SHARED, 1) != make_workload(SHARED, 2)
    assert len(make_workload(WorkloadSpec(WorkloadKind.SHARED_PREFIX, 4), 0)) == 4  # capped
    spec = WorkloadSpec(WorkloadKind.RANDOM, 5, input_len=50, vocab_size=200)
    prompts = make_workload(spec, 3)
    assert [len(r.prompt) for r in prompts] == [50] * 5 and len({r.prompt[:8] for r in prompts}) == 5
    assert all(100 <= t < 200 for r in prompts for t in r.prompt)
    with pytest.raises(ValueError, match="turns"):
        WorkloadSpec(WorkloadKind.SHARED_PREFIX, 4, turns=0)


def test_poisson_gaps_average_one_over_the_rate() -> None:
    gaps = poisson_gaps(4000, 2.0, seed=0)
    assert gaps[0] == 0.0 and 0.45 < sum(gaps) / len(gaps) < 0.55
    assert poisson_gaps(3, float("inf"), 0) == [0.0, 0.0, 0.0]


def test_attainment_counts_both_objectives_and_failures() -> None:
    slo = Slo(ttft_ms=100, tpot_ms=10)
    timings = [
        RequestTiming(True, 0.050, 0.005),  # meets both
        RequestTiming(True, 0.100, 0.010),  # exactly at both: meets
        RequestTiming(True, 0.150, 0.005),  # TTFT too slow
        RequestTiming(True, 0.050, 0.020),  # TPOT too slow
        RequestTiming(False, 0.0, 0.0),  # failed
    ]
    assert attainment(timings, slo) == pytest.approx(2 / 5)
    assert attainment([], slo) == 0.0


def test_goodput_is_the_highest_rate_meeting_the_attainment() -> None:
    assert goodput([(0.5, 1.0), (1.0, 0.95), (2.0, 0.8), (4.0, 0.1)]) == 1.0
    assert goodput([(0.5, 1.0), (1.0, 0.89), (2.0, 0.9)]) == 2.0  # the highest passing, even past a dip
    assert goodput([(0.5, 0.5)]) is None
    assert goodput([(0.5, 0.85), (1.0, 0.5)], threshold=0.8) == 0.5


def test_percentiles_are_nearest_rank_in_ms() -> None:
    stats = percentiles_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert stats == {"mean": pytest.approx(50.5), "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles_ms([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}


def test_counters_are_read_from_prometheus_text() -> None:
    instance = (
        '# TYPE kvferry:prefix_cache_queries counter\nkvferry:prefix_cache_queries_total{model_name="m"} 200.0\n'
        '# TYPE kvferry:prefix_cache_hits counter\nkvferry:prefix_cache_hits_total{model_name="m"} 150.0\n'
    )
    counts = prefix_cache_counts(instance)
    assert (counts.queries, counts.hits, counts.hit_rate) == (200.0, 150.0, 0.75)
    proxy = (
        "# TYPE kvferry_proxy:prefill_path counter\n"
        'kvferry_proxy:prefill_path_total{path="local"} 3.0\nkvferry_proxy:prefill_path_total{path="remote"} 2.0\n'
    )
    assert prefill_paths(proxy) == {"local": 3.0, "remote": 2.0}
    assert prefix_cache_counts("").hit_rate is None
    blocks = '# TYPE kvferry:num_blocks gauge\nkvferry:num_blocks{model_name="m"} 812.0\n'
    assert num_blocks(blocks) == 812 and num_blocks("") == 0
    vllm = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="5461",enable_prefix_caching="True"} 1.0\n'
    )
    assert num_blocks(vllm) == 5461
    counts = {"prefill-0": PrefixCacheCounts(100, 50), "prefill-1": PrefixCacheCounts(300, 0)}
    assert pooled_hit_rate({**counts, "decode-0": PrefixCacheCounts(10, 10)}, "prefill") == 50 / 400
    assert pooled_hit_rate(counts, "serve") is None


def test_the_vllm_deployment_serves_the_same_model_in_float32_from_its_own_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv, converted = tmp_path / "venv", tmp_path / "hf"
    monkeypatch.setattr(goodput_vllm, "ensure_vllm", lambda path: venv / "bin" / "python")
    monkeypatch.setattr(goodput_vllm, "hf_model_dir", lambda model, dtype: converted)
    args = build_parser().parse_args(["goodput", "smollm2", "--deployments", "serve,vllm", "--seed", "3"])
    assert args.deployments == ["serve", "vllm"]
    command, env = goodput_vllm.command(args, "bench", 8123)
    assert command[:3] == [str(venv / "bin" / "vllm"), "serve", str(converted.absolute())]
    assert command[command.index("--dtype") + 1] == "float32" and command[-2:] == ["--max-model-len", "2048"]
    assert command[command.index("--port") + 1] == "8123" and command[command.index("--seed") + 1] == "3"
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


@pytest.mark.slow
def test_goodput_sweeps_colocated_and_prefix_routed_pd_on_the_same_prompts(
    tiny_llama: Path, tmp_path: Path
) -> None:
    out = tmp_path / "goodput.json"
    # two deployments (each start-up costs most of the test): disagg differs from disagg-prefix
    # only in the proxy's policy, which test_prefix_routing covers
    argv = ["goodput", str(tiny_llama), "--deployments", "serve,disagg-prefix"]
    argv += ["--workload", "shared-prefix", "--num-system", "1", "--users", "2", "--turns", "2"]
    argv += ["--system-len", "48", "--turn-len", "8", "--num-prompts", "4", "--output-len", "4"]
    argv += ["--request-rate", "2", "4", "--local-prefill-tokens", "16", "--slo-ttft-ms", "600000"]
    argv += ["--slo-tpot-ms", "600000", "--output", str(out), "--log-dir", str(tmp_path / "logs")]
    argv += ["--engine-args", "--kv-cache-memory 0.005 --enforce-eager"]
    args = build_parser().parse_args(argv)
    args.func(args)

    doc = json.loads(out.read_text())
    assert [run["label"] for run in doc["runs"]] == ["serve", "disagg-prefix"]
    for run in doc["runs"]:
        assert run["goodput"] == 4.0  # generous SLOs: every request meets them at both rates
        for result in run["results"]:
            assert result["completed"] == 4 and result["failed"] == 0, result["errors"]
            assert result["slo_attainment"] == 1.0 and result["ttft_ms"]["p90"] > 0
            assert [ok for ok, _, _ in result["requests"]] == [True] * 4
            assert max(ttft for _, ttft, _ in result["requests"]) == pytest.approx(
                result["ttft_ms"]["p90"], abs=0.1
            )
            hit_rates = [r for r in result["prefix_cache_hit_rate"].values() if r is not None]
            assert hit_rates and max(hit_rates) > 0  # turn 2 and the second user reuse the prefix
            # the prefill pool may see one request only (the rest prefilled locally): >= 0
            assert result["pool_hit_rate"] is not None and result["oracle_hit_rate"] > 0
            assert result["pool_capacity_blocks"] > 0
    serve_run, prefix_run = doc["runs"]
    assert list(serve_run["results"][0]["prefix_cache_hit_rate"]) == ["serve"]
    assert all(r["pool_hit_rate"] > 0 for r in serve_run["results"])
    assert all(r["prefill_paths"] == {} for r in serve_run["results"])
    # with 16 local tokens the second turns (8 new tokens on a prefix the decoder holds) stay local
    assert all(r["prefill_paths"].get("local", 0) >= 1 for r in prefix_run["results"])
    assert "--policy prefix" in prefix_run["deployment"]
    assert out.with_suffix(".png").stat().st_size > 10_000
