"""Connector configuration errors at start-up, and a connector that raises during a step."""

import re

import pytest

from kvferry.config import CacheConfig, CaptureMode, ExecutorKind, KVRole, KVTransferConfig, ParallelConfig
from kvferry.connector.factory import resolve_spec
from kvferry.entrypoints.engine_args import parse_kv_transfer_config
from kvferry.errors import ConfigError
from kvferry.kv.spec import Layout
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS, assert_pool_full, make_llm

BAD_CONFIGS = [
    ('{"kv_connector": "NoSuchConnector"}', "unknown KV connector 'NoSuchConnector'"),
    ('{"kv_connector": "X", "kv_connector_module_path": "no_such_module_xyz"}', "does not import"),
    (
        '{"kv_connector": "Missing", "kv_connector_module_path": "tests.connectors.faulty"}',
        "has no connector class",
    ),
    (
        '{"kv_connector": "NotAConnector", "kv_connector_module_path": "tests.connectors.faulty"}',
        "does not implement",
    ),
    ('{"kv_connector": "RecordingConnector", "kv_role": "sideways"}', "kv_role must be one of"),
    ('{"kv_connector": "RecordingConnector", "kv_load_failure_policy": "retry"}', "kv_load_failure_policy"),
    ('{"kv_connector": "RecordingConnector", "colour": 1}', "unknown keys"),
    ('{"kv_connector": "RecordingConnector", "kv_connector_extra_config": [1]}', "must be a JSON object"),
    ("[1, 2]", "must be a JSON object"),
    ("{not json", "not valid JSON"),
]


@pytest.mark.parametrize(("raw", "message"), BAD_CONFIGS)
def test_bad_kv_transfer_config_is_a_clear_startup_error(raw, message):
    with pytest.raises(ConfigError, match=message):
        resolve_spec(parse_kv_transfer_config(raw))


def test_role_the_connector_does_not_support(monkeypatch):
    from kvferry.connector.recording import RecordingConnector

    monkeypatch.setattr(RecordingConnector, "supported_roles", frozenset({KVRole.PRODUCER}))
    with pytest.raises(ConfigError, match="does not support kv_role 'consumer'"):
        resolve_spec(KVTransferConfig("RecordingConnector", kv_role="consumer"))


def test_out_of_tree_connector_by_module_path():
    config = parse_kv_transfer_config(
        '{"kv_connector": "FaultyConnector", "kv_connector_module_path": "tests.connectors.faulty"}'
    )
    assert resolve_spec(config).connector_class.__module__ == "tests.connectors.faulty"


# The faulty connector counts forwards after warm-up's two: --capture auto's start-up
# measurement would run more, so these engines keep the compiled program unmeasured.
ALWAYS = CaptureMode.ALWAYS


def _faulty(policy, fail_forwards):
    return KVTransferConfig(
        "FaultyConnector",
        kv_connector_module_path="tests.connectors.faulty",
        kv_connector_extra_config={"fail_forwards": fail_forwards},
        kv_load_failure_policy=policy,
    )


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.slow  # compiles a forward
def test_raising_connector_with_fail_policy_fails_only_that_steps_requests(tiny_llama):
    expected = [o.outputs[0].token_ids for o in make_llm(tiny_llama).generate(PROMPT_TEXTS[:2], GREEDY)]
    llm = make_llm(tiny_llama, kv_transfer=_faulty("fail", [1]), capture=ALWAYS)
    first = llm.generate(PROMPT_TEXTS[:2], GREEDY)  # both are in the failing forward
    assert all(o.outputs[0].finish_reason == "error" and o.error for o in first)
    again = llm.generate(PROMPT_TEXTS[:2], GREEDY)  # the engine keeps serving
    assert [o.outputs[0].token_ids for o in again] == expected
    assert_pool_full(llm)


@pytest.mark.slow  # compiles a forward
def test_raising_connector_with_recompute_policy_gives_correct_output(tiny_llama):
    expected = [o.outputs[0].token_ids for o in make_llm(tiny_llama).generate(PROMPT_TEXTS[:4], GREEDY)]
    llm = make_llm(tiny_llama, kv_transfer=_faulty("recompute", [1, 3]), capture=ALWAYS)
    outputs = llm.generate(PROMPT_TEXTS[:4], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert_pool_full(llm)


def test_role_and_load_failure_policy_are_enums_accepting_their_spellings():
    from kvferry.config import KVRole, KVTransferConfig, LoadFailurePolicy

    config = KVTransferConfig(kv_role="consumer", kv_load_failure_policy="recompute")
    assert config.kv_role is KVRole.CONSUMER and config.kv_load_failure_policy is LoadFailurePolicy.RECOMPUTE
    assert f"{config.kv_role}" == "consumer" and KVTransferConfig().kv_role is KVRole.BOTH
    with pytest.raises(ConfigError, match="kv_load_failure_policy must be one of"):
        KVTransferConfig(kv_load_failure_policy="retry")


@pytest.mark.parametrize(
    ("build", "member", "bad", "message"),
    [
        (
            lambda v: CacheConfig(layout=v).layout,
            Layout.HND,
            "NCHW",
            "unknown KV layout 'NCHW'; choose one of NHD, HND",
        ),
        (
            lambda v: ParallelConfig(executor=v).executor,
            ExecutorKind.RAY,
            "mpi",
            "unknown executor 'mpi'; choose one of uniproc, multiproc, ray",
        ),
    ],
)
def test_layout_and_executor_are_enums_accepting_their_spellings(build, member, bad, message):
    assert build(member.value) is member and build(member) is member
    with pytest.raises(ConfigError, match=re.escape(message)):
        build(bad)
