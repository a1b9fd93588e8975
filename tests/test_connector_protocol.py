"""One statement of the scheduler half's contract: the SchedulerConnector protocol.
KVConnectorBase (every in-tree connector's base) implements each of its members with the
same signature, and the scheduler takes the load-failure policy from the connector."""

from __future__ import annotations

import inspect

import pytest

from kvferry.config import KVTransferConfig, LoadFailurePolicy
from kvferry.connector.base import KVConnectorBase
from kvferry.scheduler.interfaces import SchedulerConnector


def _protocol_members() -> list[str]:
    return [name for name in vars(SchedulerConnector) if not name.startswith("_")]


def test_the_protocol_holds_every_scheduler_half_member() -> None:
    assert set(_protocol_members()) >= {"release_kept", "load_failure_policy", "request_finished"}


@pytest.mark.parametrize("name", _protocol_members())
def test_the_base_connector_implements_the_protocol_with_its_signature(name: str) -> None:
    ours, theirs = vars(SchedulerConnector)[name], inspect.getattr_static(KVConnectorBase, name)
    if isinstance(ours, property):
        assert isinstance(theirs, property)
        ours, theirs = ours.fget, theirs.fget
    # the same parameters; a return type may be narrower (build_connector_meta's metadata)
    assert inspect.signature(theirs).parameters == inspect.signature(ours).parameters


def test_the_scheduler_follows_the_connectors_load_failure_policy() -> None:
    from tests.test_scheduler import FakeConnector, make_scheduler

    connector = FakeConnector()
    connector.load_failure_policy = LoadFailurePolicy.RECOMPUTE
    assert make_scheduler(connector=connector).kv_load_failure_policy is LoadFailurePolicy.RECOMPUTE
    assert make_scheduler().kv_load_failure_policy is LoadFailurePolicy.FAIL
    config = KVTransferConfig("NixlConnector", kv_load_failure_policy="recompute")
    assert KVConnectorBase.load_failure_policy.fget(_HasConfig(config)) is LoadFailurePolicy.RECOMPUTE


class _HasConfig:
    def __init__(self, transfer_config: KVTransferConfig):
        self.transfer_config = transfer_config
