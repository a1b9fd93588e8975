"""NixlConnector pieces without NIXL: params contract, lease table, scheduler seam."""

from __future__ import annotations

import pytest

from kvferry.config import KVRole
from kvferry.connector.nixl.leases import Hold, LeaseTable, read_sources, readers_of
from kvferry.connector.nixl.params import RemotePrefill, parse_remote_prefill, validate_params
from kvferry.connector.nixl.protocol import (
    EXPIRED,
    HELD,
    MISMATCH,
    UNKNOWN,
    CheckReply,
    CheckStatus,
    Codec,
    EngineInfo,
    GroupInfo,
    GroupKind,
    HandshakeReply,
    RankInfo,
)
from kvferry.connector.nixl.validate import blocks_to_read, check_remote
from kvferry.errors import InvalidRequestError
from kvferry.messages.engine_core import FinishReason
from kvferry.model.layers.parallel import kv_head_range
from tests.test_scheduler import (
    FakeConnector,
    FakeRunner,
    Run,
    add,
    assert_all_free,
    make_scheduler,
    run_all,
    step,
)

GOOD = RemotePrefill("e1", "127.0.0.1", 5555, ((3, 4),), "req-1", 20, 1, 1e9, 7).to_params()


# ---- params ---------------------------------------------------------------------------


def test_params_roundtrip():
    assert parse_remote_prefill(GOOD) == RemotePrefill(
        "e1", "127.0.0.1", 5555, ((3, 4),), "req-1", 20, 1, 1e9, 7
    )
    assert parse_remote_prefill({"do_remote_decode": True}) is None
    assert parse_remote_prefill({"do_remote_prefill": False, "remote_block_ids": None}) is None


@pytest.mark.parametrize(
    "change",
    [
        {"do_remote_prefill": "yes"},
        {"remote_engine_id": 3},
        {"remote_engine_id": ""},
        {"remote_port": "5555"},
        {"remote_port": 70000},
        {"remote_block_ids": [3, 4]},
        {"remote_block_ids": [[3, -1]]},
        {"remote_block_ids": [[3, True]]},
        {"remote_block_ids": []},
        {"remote_num_tokens": 0},
        {"remote_num_tokens": 2.5},
        {"remote_tp_size": None},
        {"lease_expiry": "soon"},
        {"first_token_id": -3},
        {"remote_request_id": None},
    ],
)
def test_malformed_params_are_client_errors(change):
    with pytest.raises(InvalidRequestError) as info:
        validate_params(KVRole.CONSUMER, {**GOOD, **change})
    assert info.value.param == "kv_transfer_params"


def test_params_must_fit_the_role():
    validate_params(KVRole.PRODUCER, {"do_remote_decode": True})
    validate_params(KVRole.BOTH, GOOD)
    with pytest.raises(InvalidRequestError):
        validate_params(KVRole.CONSUMER, {"do_remote_decode": True})
    with pytest.raises(InvalidRequestError):
        validate_params(KVRole.PRODUCER, GOOD)
    with pytest.raises(InvalidRequestError):
        validate_params(KVRole.BOTH, {"do_remote_decode": 1})
    with pytest.raises(InvalidRequestError):
        validate_params(KVRole.BOTH, ["do_remote_decode"])  # type: ignore[arg-type]


# ---- leases -----------------------------------------------------------------------------


def _hold(request_id="p", lease_s=10.0, now=100.0) -> Hold:
    return Hold(request_id, ((1, 2),), 20, "h", lease_s, expiry=now + lease_s)


@pytest.mark.parametrize(
    ("rank", "tp", "consumer_tp", "readers"),
    [(0, 1, 1, [0]), (0, 1, 2, [0, 1]), (0, 2, 1, [0]), (1, 2, 1, [0]), (1, 2, 2, [1]), (1, 2, 4, [2, 3])],
)
def test_readers_of(rank, tp, consumer_tp, readers):
    assert readers_of(rank, tp, consumer_tp, total_heads=4) == readers


@pytest.mark.parametrize(
    ("total", "tp", "ranges"),
    [
        (4, 2, [(0, 2), (2, 2)]),
        (3, 2, [(0, 2), (2, 1)]),  # uneven: the first ranks take one more
        (2, 4, [(0, 1), (0, 1), (1, 1), (1, 1)]),  # fewer heads than ranks: replicated
    ],
)
def test_kv_head_ranges_follow_tensor_parallel_attention(total, tp, ranges):
    assert [kv_head_range(r, tp, total) for r in range(tp)] == ranges


def test_readers_with_replicated_and_uneven_heads():
    assert readers_of(0, 1, 4, total_heads=2) == [0, 1, 2, 3]  # decode replicas all read
    assert readers_of(1, 4, 1, total_heads=2) == [0]  # a prefill replica is read too
    assert readers_of(3, 4, 2, total_heads=2) == [1]
    assert [readers_of(p, 2, 3, total_heads=3) for p in range(2)] == [[0, 1], [2]]


@pytest.mark.parametrize(
    ("rank", "tp", "producer_tp", "total_heads", "sources"),
    [
        (0, 1, 2, 1, [0]),  # one latent row on both prefill ranks: read once, from rank 0
        (0, 2, 2, 1, [0]),  # two decode ranks spread over the replicas
        (1, 2, 2, 1, [1]),
        (0, 2, 1, 1, [0]),  # every decode rank reads its own copy from the one prefill rank
        (1, 2, 1, 1, [0]),
        (0, 1, 4, 2, [0, 2]),  # replicated GQA heads: one replica of each
        (0, 1, 2, 4, [0, 1]),  # split heads: every holder (no replicas)
        (1, 2, 4, 4, [2, 3]),
    ],
)
def test_each_head_is_read_from_one_prefill_rank(rank, tp, producer_tp, total_heads, sources):
    assert read_sources(rank, tp, producer_tp, total_heads) == sources
    for source in sources:  # a source is always told DONE (it is among the readers' ranks)
        assert rank in readers_of(source, producer_tp, tp, total_heads)


def test_lease_acks_while_held_and_ends_when_every_reader_reported():
    table = LeaseTable(rank=0, tp=1, total_heads=2)
    table.add(_hold(), now=0.0, wall_now=100.0)
    assert table.check("p", [[1, 2]], 20, "h", now=1.0) == (HELD, "")
    assert table.check("p", [[1, 3]], 20, "h", now=1.0)[0] == MISMATCH
    assert table.check("p", [[1, 2]], 20, "other prompt", now=1.0)[0] == MISMATCH
    assert table.check("q", [[1, 2]], 20, "h", now=1.0)[0] == UNKNOWN
    first = table.done("p", "dec", 0, consumer_tp=2, ok=True)
    assert first.known and first.ok and not table.take_finished()  # decode rank 1 still reads
    assert table.done("p", "dec", 1, consumer_tp=2, ok=True).ok
    assert table.take_finished() == {"p"}
    late = table.done("p", "dec", 1, consumer_tp=2, ok=True)
    assert late.known and not late.ok  # ended: never an ACK again
    assert table.check("p", [[1, 2]], 20, "h", now=2.0)[0] == EXPIRED


def test_expired_lease_frees_and_refuses_the_late_read():
    table = LeaseTable(rank=0, tp=1, total_heads=2)
    table.add(_hold(lease_s=5.0), now=0.0, wall_now=100.0)
    table.heartbeat(["p"], now=4.0)  # extends to 9
    assert table.expire(now=8.0) == [] and len(table) == 1
    assert table.expire(now=9.5) == ["p"] and table.num_expired == 1
    assert table.take_finished() == {"p"}
    verdict = table.done("p", "dec", 0, consumer_tp=1, ok=True)
    assert verdict.known and not verdict.ok and "expired" in verdict.message


def test_release_and_unknown_reader():
    table = LeaseTable(rank=1, tp=2, total_heads=2)
    table.add(_hold(), now=0.0, wall_now=100.0)
    assert not table.done("p", "dec", 0, consumer_tp=2, ok=True).ok  # decode rank 0 reads prefill rank 0
    table.release("p", "released by the decoder")
    assert table.take_finished() == {"p"} and len(table) == 0
    assert not table.done("nothing", "dec", 0, consumer_tp=1, ok=True).known
    table.release("p", "again")  # idempotent: an ended lease stays ended
    assert not table.take_finished()
    verdict = table.done("p", "dec", 1, consumer_tp=2, ok=True)
    assert verdict.known and not verdict.ok and "released by the decoder" in verdict.message


def test_a_check_status_crosses_the_wire_as_its_member_and_a_forged_one_is_dropped():
    codec = Codec()
    reply = codec.server_message(codec.encode(CheckReply(3, EXPIRED, "gone", 2.0)))
    assert isinstance(reply, CheckReply) and reply.status is CheckStatus.EXPIRED
    forged = codec.encode(CheckReply(4, "expired-ish", "", 0.0))  # type: ignore[arg-type]
    assert codec.server_message(forged) is None  # undecodable: logged and dropped


def test_a_group_kind_crosses_the_wire_as_its_member_and_a_forged_one_is_dropped():
    codec = Codec()
    sliding = GroupInfo(GroupKind.SLIDING, 16, 2, 16, "float32", 10, ["l1"])
    reply = codec.server_message(codec.encode(HandshakeReply(1, _info(groups=[sliding]))))
    assert isinstance(reply, HandshakeReply) and reply.info is not None
    assert reply.info.groups[0].kind is GroupKind.SLIDING
    forged = GroupInfo("chunked", 16, 2, 16, "float32", 10, ["l1"])  # type: ignore[arg-type]
    assert codec.server_message(codec.encode(HandshakeReply(2, _info(groups=[forged])))) is None


# ---- scheduler seam ---------------------------------------------------------------------


class DeferringConnector(FakeConnector):
    """Cannot tell a request's hits for `defer` steps; rejects requests named 'bad*'."""

    def __init__(self, defer: int):
        super().__init__(external=0)
        self.defer = defer

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.req_id.startswith("bad"):
            raise InvalidRequestError("forged kv_transfer_params", param="kv_transfer_params")
        if request.req_id == "slow" and self.defer > 0:
            self.defer -= 1
            return None, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


def test_deferred_request_keeps_its_place_and_others_run():
    sched = make_scheduler(connector=DeferringConnector(defer=3))
    runner, run = FakeRunner(), Run()
    add(sched, "slow", list(range(10)), max_tokens=2)
    add(sched, "fast", list(range(20, 30)), max_tokens=2)
    so = step(sched, runner, run)
    assert set(so.num_scheduled_tokens) == {"fast"}
    assert sched.waiting[0].req_id == "slow"
    for _ in range(2):
        assert "slow" not in step(sched, runner, run).num_scheduled_tokens
    assert "slow" in step(sched, runner, run).num_scheduled_tokens
    run_all(sched, runner, run)
    assert run.final("slow").finished and run.final("fast").finished
    assert_all_free(sched)


def test_connector_rejection_is_a_client_error():
    sched = make_scheduler(connector=DeferringConnector(defer=0))
    runner, run = FakeRunner(), Run()
    add(sched, "bad", list(range(10)))
    add(sched, "good", list(range(10)), max_tokens=1)
    step(sched, runner, run)
    bad = run.final("bad")
    assert bad.finish_reason == FinishReason.ERROR and bad.invalid_param == "kv_transfer_params"
    assert "forged" in bad.error
    assert run.final("good").finished and run.final("good").invalid_param is None
    assert_all_free(sched)


# ---- params against the remote's handshake ----------------------------------------------


def _info(**change) -> EngineInfo:
    group = GroupInfo(GroupKind.FULL, 16, 2, 16, "float32", 0, ["l0"])
    rank = RankInfo(0, "127.0.0.1", 5555, "agent", b"", [], 0, 2)
    fields = dict(
        engine_id="e1", compat_hash="c", tp_size=1, block_size=16, num_blocks=10, layout="NHD",
        total_kv_heads=2, lease_s=30.0, groups=[group], ranks=[rank],
    )  # fmt: skip
    return EngineInfo(**{**fields, **change})


class _Local:
    compat, block_size, groups = "c", 16, [GroupInfo(GroupKind.FULL, 16, 2, 16, "float32", 0, ["l0"])]


@pytest.mark.parametrize(
    ("info_change", "params_change", "prompt_len", "expect"),
    [
        ({}, {}, 20, None),
        ({"engine_id": "e2"}, {}, 20, "is not the engine"),
        ({"compat_hash": "x"}, {}, 20, "incompatible"),
        ({"block_size": 32}, {}, 20, "blocks of 32 tokens"),
        ({"tp_size": 2}, {}, 20, "remote_tp_size"),
        ({}, {"remote_num_tokens": 21}, 20, "exceeds the prompt"),
        ({}, {"remote_block_ids": [[3, 4, 5]]}, 20, "take 2"),
        ({}, {"remote_block_ids": [[3]]}, 20, "take 2"),
        ({}, {"remote_block_ids": [[3, 10]]}, 20, "out of range"),
        ({}, {"remote_block_ids": [[3, 4], [5, 6]]}, 20, "groups"),
    ],
)
def test_params_checked_against_the_handshake(info_change, params_change, prompt_len, expect):
    remote = parse_remote_prefill({**GOOD, **params_change})
    problem = check_remote(remote, _info(**info_change), _Local(), prompt_len)
    if expect is None:
        assert problem is None
    else:
        assert problem is not None and expect in problem, problem


def test_params_with_a_placeholder_where_a_decoder_reads_are_refused():
    """A hybrid prefill's blocks: a sliding group may hold the placeholder (block 0) only
    before the blocks the last prompt token's window sees; a full group nowhere."""
    groups = [
        GroupInfo(GroupKind.FULL, 16, 2, 16, "float32", 0, ["l0"]),
        GroupInfo(GroupKind.SLIDING, 16, 2, 16, "float32", 10, ["l1"]),
    ]
    local = _Local()
    local.groups = groups

    def problem(full: list[int], sliding: list[int]) -> str | None:
        params = {**GOOD, "remote_block_ids": [full, sliding], "remote_num_tokens": 40}
        return check_remote(parse_remote_prefill(params), _info(groups=groups), local, 40)

    assert problem([1, 2, 3], [0, 4, 5]) is None  # token 39 sees 30..39: blocks 1 and 2
    assert "remote_block_ids[1] has the placeholder block 0" in (problem([1, 2, 3], [4, 0, 5]) or "")
    assert "remote_block_ids[0] has the placeholder block 0" in (problem([0, 2, 3], [4, 6, 5]) or "")


def test_blocks_to_read_skip_the_local_hit_and_what_the_window_cannot_see():
    full = GroupInfo(GroupKind.FULL, 4, 2, 16, "float32", 0, ["a"])
    sliding = GroupInfo(GroupKind.SLIDING, 4, 2, 16, "float32", 6, ["b"])
    local = ([10, 11, 12, 13, 14], [20, 21, 22, 23, 24])
    remote = ([1, 2, 3, 4, 5], [0, 0, 7, 8, 9])  # the prefiller dropped blocks out of its window
    # tokens 4..18 to read (block 0 is a local prefix hit); the token at 19 sees 14..19
    got = blocks_to_read([full, sliding], local, remote, start=4, end=19, remote_null=0)
    assert got == (((11, 12, 13, 14), (2, 3, 4, 5)), ((23, 24), (8, 9)))
    # the token at 17 sees 12..17: from block 3 on, not block 2 (position 11)
    assert blocks_to_read([sliding], local[1:], remote[1:], 0, 17, remote_null=0) == (((23, 24), (8, 9)),)
    assert blocks_to_read([full], ([10, 11],), ([0, 1],), 0, 8, remote_null=-1) == (((10, 11), (0, 1)),)
