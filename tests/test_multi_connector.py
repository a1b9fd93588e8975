"""MultiConnector: composed connectors give the same outputs, load from the first child with
a hit, save to all, and free a request's blocks only when every delaying child is done."""

import json

import pytest

from kvferry.config import KVTransferConfig
from kvferry.connector.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from kvferry.connector.multi import MultiConnector, MultiMetadata
from kvferry.errors import ConfigError
from kvferry.messages.kv_connector import KVConnectorStats
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm
from tests.offload_support import GREEDY, LONG, disk_extra, evict_device_cache, tokens

PROMPTS = [*PROMPT_TEXTS[:4], LONG]


def _offload(**extra) -> dict:
    return {"kv_connector": "OffloadConnector", "kv_connector_extra_config": extra}


def _multi(*children: dict, policy: str = "fail") -> KVTransferConfig:
    return KVTransferConfig(
        "MultiConnector",
        kv_connector_extra_config={"connectors": list(children)},
        kv_load_failure_policy=policy,
    )


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return tokens(make_llm(tiny_llama).generate(PROMPTS, GREEDY))


def _two_passes(llm):
    first = llm.generate(PROMPTS, GREEDY)
    assert_pool_full(llm)
    evict_device_cache(llm)
    second = llm.generate(PROMPTS, GREEDY)
    assert_pool_full(llm)
    return first, second


def test_two_offload_tiers_load_from_the_first_with_a_hit(tiny_llama, expected, tmp_path):
    llm = make_llm(
        tiny_llama, kv_transfer=_multi(_offload(dram_blocks=64), _offload(**disk_extra(tmp_path, 0, 64)))
    )
    first, second = _two_passes(llm)
    assert tokens(first) == expected and tokens(second) == expected
    a, b = (child.scheduler for child in llm.engine.connector.children)
    num_loaded = sum(o.num_cached_tokens for o in second) // 16
    assert num_loaded > 0 and a.counters["loads_dram"] == num_loaded
    assert b.counters["loads_disk"] == 0  # never asked: the first child had the hits
    assert a.counters["saves"] == b.counters["saves"] > 0  # both saved every block
    assert len(a.index) == len(b.index)


@pytest.mark.slow  # several seconds (make test-all)
def test_a_later_child_serves_when_the_first_has_no_hit(tiny_llama, expected):
    # The first child keeps only the last block it saved: no prefix hit for LONG there.
    llm = make_llm(tiny_llama, kv_transfer=_multi(_offload(dram_blocks=1), _offload(dram_blocks=64)))
    _, second = _two_passes(llm)
    assert tokens(second) == expected and second[-1].num_cached_tokens == 112
    a, b = (child.scheduler for child in llm.engine.connector.children)
    assert b.counters["loads_dram"] >= 7 and a.counters["loads_dram"] <= 1


@pytest.mark.slow  # several seconds (make test-all)
def test_offload_beside_a_recording_connector(tiny_llama, expected, tmp_path):
    record = tmp_path / "hooks.jsonl"
    recording = {
        "kv_connector": "RecordingConnector",
        "kv_connector_extra_config": {"record_path": str(record)},
    }
    llm = make_llm(tiny_llama, kv_transfer=_multi(recording, _offload(dram_blocks=64)))
    first, second = _two_passes(llm)
    assert tokens(first) == expected and tokens(second) == expected
    assert second[-1].num_cached_tokens == 112
    hooks = [json.loads(line) for line in record.read_text().splitlines()]
    worker_steps = [
        r["step"] for r in hooks if r["role"] == "worker" and r["hook"] == "bind_connector_metadata"
    ]
    built = [r["step"] for r in hooks if r["role"] == "scheduler" and r["hook"] == "build_connector_meta"]
    assert worker_steps == built  # the recording child got its own metadata every step


def test_bad_multi_configs_are_config_errors(tiny_llama):
    for extra, match in [
        ({}, "non-empty list"),
        ({"connectors": [{"kv_role": "both"}]}, "naming kv_connector"),
        ({"connectors": [_offload()], "x": 1}, "unknown keys"),
        ({"connectors": [{"kv_connector": "Nope"}]}, "unknown KV connector"),
        ({"connectors": [{**_offload(), "bogus": 1}]}, "connectors\\[0\\]"),
        ({"connectors": [_offload(dram_gib=-1)]}, "dram_gib"),
    ]:
        with pytest.raises(ConfigError, match=match):
            make_llm(
                tiny_llama, kv_transfer=KVTransferConfig("MultiConnector", kv_connector_extra_config=extra)
            )


# ---- finished_sending across children, without an engine ------------------------------


class _Delaying(KVConnectorBase):
    """Delays every free; its worker half reports what the test tells it to."""

    def __init__(self, engine_config, role, kv_cache_config, tp_rank=0):
        super().__init__(engine_config, role, kv_cache_config, tp_rank)
        self.to_report: set[str] = set()

    def request_finished(self, request, block_ids):
        return self.extra_config.get("delay", True), {self.extra_config["name"]: True}

    def get_finished(self, finished_req_ids):
        done, self.to_report = self.to_report, set()
        return done, set()

    def get_stats(self):
        return KVConnectorStats({"reports": 1})


class _Req:
    req_id = "r1"


def _halves(tiny_llama, delays):
    from kvferry.config import EngineConfig
    from kvferry.connector.factory import resolve_connector
    from kvferry.model.resolve import resolve_model_config

    children = [
        {
            "kv_connector": "_Delaying",
            "kv_connector_module_path": __name__,
            "kv_connector_extra_config": {"name": f"c{i}", "delay": d},
        }
        for i, d in enumerate(delays)
    ]
    model = resolve_model_config(str(tiny_llama))
    config = resolve_connector(EngineConfig(model=model, kv_transfer=_multi(*children)))
    return MultiConnector(config, KVConnectorRole.SCHEDULER, None), MultiConnector(
        config, KVConnectorRole.WORKER, None
    )


def _step(sched, worker, finished=frozenset()):
    from kvferry.messages.scheduler_output import SchedulerOutput

    meta = sched.build_connector_meta(SchedulerOutput.empty())
    assert isinstance(meta, MultiMetadata) and all(isinstance(m, KVConnectorMetadata) for m in meta.children)
    with worker.bound(meta):
        return worker.collect_output(set(finished))


def test_a_request_is_sent_only_when_every_delaying_child_reported(tiny_llama):
    sched, worker = _halves(tiny_llama, [True, False, True])
    delay, params = sched.request_finished(_Req(), ([],))
    assert delay and params == {"c0": True, "c1": True, "c2": True}
    worker.children[0].to_report = {"r1"}
    worker.children[1].to_report = {"r1"}  # did not delay: its report does not count
    out = _step(sched, worker, finished={"r1"})
    assert out.finished_sending == set() and out.stats.data == {"reports": 3}
    worker.children[2].to_report = {"r1"}
    assert _step(sched, worker).finished_sending == {"r1"}
    assert _step(sched, worker).finished_sending == set()


def test_reports_before_the_delay_is_known_still_count(tiny_llama):
    sched, worker = _halves(tiny_llama, [True, True])
    worker.children[0].to_report = {"r1"}
    worker.children[1].to_report = {"r1"}
    assert _step(sched, worker).finished_sending == set()  # early: the request has not finished
    assert sched.request_finished(_Req(), ([],))[0]
    assert _step(sched, worker, finished={"r1"}).finished_sending == {"r1"}


@pytest.mark.slow  # several seconds (make test-all)
def test_children_inherit_the_parents_role_and_policy(tiny_llama, expected):
    transfer = KVTransferConfig(
        "MultiConnector",
        kv_role="producer",  # e.g. a prefill instance with a local offload tier beside P/D
        kv_connector_extra_config={"connectors": [_offload(dram_blocks=64)]},
        kv_load_failure_policy="recompute",
    )
    llm = make_llm(tiny_llama, kv_transfer=transfer)
    (child,) = llm.engine.connector.children
    assert child.transfer_config.kv_role == "producer"
    assert child.transfer_config.kv_load_failure_policy == "recompute"
    _, second = _two_passes(llm)
    assert tokens(second) == expected and second[-1].num_cached_tokens == 112
