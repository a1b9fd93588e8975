"""KVOutputAggregator: quorum counting, failures held until the quorum, stats merged."""

from kvferry.connector.aggregator import KVOutputAggregator
from kvferry.messages.kv_connector import KVConnectorOutput, KVConnectorStats


def out(**kw):
    return KVConnectorOutput(**{k: set(v) if k != "stats" else v for k, v in kw.items()})


def test_request_finishes_only_when_every_worker_reported_it():
    agg = KVOutputAggregator(expected_finished_count=2)
    step1 = agg.aggregate([out(finished_sending={"a", "b"}), out(finished_sending={"a"})])
    assert step1.finished_sending == {"a"}
    step2 = agg.aggregate([out(), out(finished_sending={"b"})])
    assert step2.finished_sending == {"b"}
    assert agg.pending == 0


def test_sending_and_receiving_are_counted_separately():
    agg = KVOutputAggregator(2)
    first = agg.aggregate([out(finished_sending={"x"}), out(finished_recving={"x"})])
    assert not first.finished_sending and not first.finished_recving
    second = agg.aggregate([out(finished_recving={"x"}), out(finished_sending={"x"})])
    assert second.finished_sending == {"x"} and second.finished_recving == {"x"}


def test_failed_recv_is_held_until_the_request_completes_its_quorum():
    agg = KVOutputAggregator(3)
    r1 = agg.aggregate([out(finished_recving={"r"}, failed_recving={"r"}), None, out()])
    assert not r1.failed_recving and not r1.finished_recving
    r2 = agg.aggregate([out(), out(finished_recving={"r"}), out()])
    assert not r2.failed_recving
    r3 = agg.aggregate([out(), out(), out(finished_recving={"r"})])
    assert r3.finished_recving == {"r"} and r3.failed_recving == {"r"}


def test_invalid_blocks_are_unioned_and_stats_merged():
    agg = KVOutputAggregator(2)
    s1 = KVConnectorStats({"bytes": 10, "transfers": 1})
    s2 = KVConnectorStats({"bytes": 5, "failed": 1})
    merged = agg.aggregate([out(invalid_block_ids={1, 2}, stats=s1), out(invalid_block_ids={2, 7}, stats=s2)])
    assert merged.invalid_block_ids == {1, 2, 7}
    assert merged.stats.data == {"bytes": 15, "transfers": 1, "failed": 1}


def test_no_outputs_gives_none_and_single_worker_passes_through():
    assert KVOutputAggregator(1).aggregate([None]) is None
    agg = KVOutputAggregator(1)
    assert agg.aggregate([out(finished_sending={"q"}, finished_recving={"z"})]).finished_sending == {"q"}


def test_a_worker_reporting_twice_counts_once():
    agg = KVOutputAggregator(2)
    assert not agg.aggregate([out(finished_sending={"d"}), out()]).finished_sending
    assert not agg.aggregate([out(finished_sending={"d"}), out()]).finished_sending
    assert agg.pending == 1
    assert agg.aggregate([out(), out(finished_sending={"d"})]).finished_sending == {"d"}
    assert agg.pending == 0


def test_a_failed_receive_whose_quorum_never_completes_is_surfaced_after_the_bound():
    agg = KVOutputAggregator(2, failed_quorum_steps=3)
    first = agg.aggregate([out(finished_recving={"f"}, failed_recving={"f"}), None])
    assert not first.failed_recving
    assert not agg.aggregate([None, None]).failed_recving
    assert not agg.aggregate([out(), None]).failed_recving
    overdue = agg.aggregate([None, None])
    assert overdue.finished_recving == {"f"} and overdue.failed_recving == {"f"}
    assert agg.pending == 0
    late = agg.aggregate([None, out(finished_recving={"f"}, failed_recving={"f"})])
    assert not late.finished_recving and not late.failed_recving and agg.pending == 0


def test_a_failure_completed_within_the_bound_is_not_surfaced_twice():
    agg = KVOutputAggregator(2, failed_quorum_steps=2)
    agg.aggregate([out(finished_recving={"g"}, failed_recving={"g"}), out()])
    done = agg.aggregate([out(), out(finished_recving={"g"})])
    assert done.finished_recving == {"g"} and done.failed_recving == {"g"}
    for _ in range(3):
        assert agg.aggregate([out(), out()]).failed_recving == set()


def test_abandoned_requests_are_forgotten_once_reported_or_after_the_bound():
    """A long-running server keeps no record per abandoned request: an abandoned receive is
    forgotten when its missing workers report it late, or after another bound of steps."""
    agg = KVOutputAggregator(2, failed_quorum_steps=2)
    both = {"late", "never"}
    agg.aggregate([out(finished_recving=both, failed_recving=both), None])
    agg.aggregate([None, None])
    overdue = agg.aggregate([None, None])
    assert overdue.failed_recving == {"late", "never"} and agg.abandoned == 2
    late = agg.aggregate([None, out(finished_recving={"late"}, failed_recving={"late"})])
    assert not late.finished_recving and not late.failed_recving
    assert agg.abandoned == 1  # "late" has every worker's report: forgotten
    agg.aggregate([None, None])
    assert agg.abandoned == 0 and agg.pending == 0  # "never": forgotten after the bound
    for _ in range(3):  # the late failure is not surfaced a second time
        assert agg.aggregate([None, None]) is None
