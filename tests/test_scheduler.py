"""Scheduler driven by a fake model runner: budgets, prefix hits, preemption, stops, connector seam.

The fake runner keeps a fake KV cache (one entry per slot: a digest of the token prefix
ending there) and checks, every step, that each request's computed positions hold exactly
its own prefix, so a wrong prefix hit or a block shared by mistake fails the test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvferry.config import CacheConfig, LoadFailurePolicy, SchedulerConfig
from kvferry.errors import InvalidRequestError
from kvferry.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, Layout
from kvferry.messages.engine_core import EngineCoreOutput, EngineCoreRequest, FinishReason
from kvferry.messages.kv_connector import KVConnectorOutput
from kvferry.messages.model_runner import ModelRunnerOutput
from kvferry.messages.scheduler_output import SchedulerOutput
from kvferry.sampling_params import SamplingParams
from kvferry.scheduler import hashing
from kvferry.scheduler.request import Request, RequestStatus
from kvferry.scheduler.scheduler import Scheduler
from kvferry.spec_decode.verify import accepted_tokens

BLOCK = 4
EOS = 2


def make_scheduler(
    num_blocks=64, budget=64, max_seqs=16, chunked=True, caching=True, max_len=256, **kw
) -> Scheduler:
    """A scheduler over one full-attention group of `num_blocks` blocks of BLOCK tokens."""
    spec = FullAttentionSpec(BLOCK, 2, 8, torch.float32)
    kv_config = KVCacheConfig((KVCacheGroup(spec, ("layers.0",)),), (), Layout.NHD, num_blocks, num_blocks)
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_chunked_prefill=chunked
    )
    return Scheduler(
        config, CacheConfig(block_size=BLOCK, enable_prefix_caching=caching), kv_config, max_len, **kw
    )


def add(sched: Scheduler, req_id: str, prompt: list[int], arrival: float = 0.0, **params) -> None:
    params.setdefault("max_tokens", 8)
    params.setdefault("temperature", 0.0)
    sched.add_request(EngineCoreRequest(req_id, prompt, SamplingParams(**params), arrival), [EOS])


def next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return 100 + (hash(tuple(tokens[-3:])) + len(tokens)) % 97


@dataclass
class FakeState:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    digests: list[int] = field(default_factory=list)  # digest of tokens[: p + 1] per position p
    forced: int | None = None  # the first sample's token (NewRequestData.forced_token_id)

    def digest(self, pos: int) -> int:
        while len(self.digests) <= pos:
            prev = self.digests[-1] if self.digests else 0
            self.digests.append(hash((prev, self.tokens[len(self.digests)])))
        return self.digests[pos]


class FakeRunner:
    """Plays the workers: keeps per-request state from SchedulerOutputs and a fake KV cache."""

    def __init__(self, block_size: int = BLOCK, token_fn=next_token):
        self.block_size = block_size
        self.token_fn = token_fn
        self.states: dict[str, FakeState] = {}
        self.kv: dict[int, int] = {}  # slot -> digest of the prefix whose last token is there
        self.kv_output: KVConnectorOutput | None = None  # handed back once, then cleared

    def slot(self, state: FakeState, pos: int) -> int:
        return state.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def preload(self, tokens: list[int], block_ids: list[int], num: int) -> None:
        """Write what a connector's worker half would load: the KV of the first `num` tokens."""
        state = FakeState(list(tokens), list(block_ids), 0)
        for pos in range(num):
            self.kv[self.slot(state, pos)] = state.digest(pos)

    def check_kv(self, req_id: str, upto: int) -> None:
        state = self.states[req_id]
        for pos in range(upto):
            assert self.kv.get(self.slot(state, pos)) == state.digest(pos), f"{req_id}: wrong KV at {pos}"

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            (ids,) = new.block_ids
            self.states[new.req_id] = FakeState(
                list(new.token_ids), list(ids), new.num_computed_tokens, forced=new.forced_token_id
            )
            self.check_kv(new.req_id, new.num_computed_tokens)  # prefix hits hold the right KV
        cached = so.scheduled_cached_reqs
        for req_id, new_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.states[req_id]
            assert state.num_computed == num_computed
            if new_ids is not None:
                state.block_ids.extend(new_ids[0])
        out = ModelRunnerOutput()
        for req_id, num in so.num_scheduled_tokens.items():
            out.req_ids.append(req_id)
            out.sampled_token_ids.append(
                self.compute(req_id, num, so.scheduled_spec_token_ids.get(req_id, []))
            )
            out.logprobs.append(None)
        out.kv_connector_output, self.kv_output = self.kv_output, None
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        return out

    def compute(self, req_id: str, num: int, drafts: list[int]) -> list[int]:
        """`num` tokens from the computed ones, the last len(drafts) of them `drafts`: their
        KV written, then (at the end of what is known) the kept drafts and one more token."""
        state = self.states[req_id]
        end, known = state.num_computed + num, len(state.tokens)
        assert end - len(drafts) <= known and end <= len(state.block_ids) * self.block_size
        self.check_kv(req_id, state.num_computed)
        state.tokens.extend(drafts)  # their rows' KV is written as if they were the request's
        for pos in range(state.num_computed, end):
            self.kv[self.slot(state, pos)] = state.digest(pos)
        if end < known:
            state.num_computed = end
            return []  # a prompt chunk: no sample yet
        samples = [self.token_fn(state.tokens[: pos + 1]) for pos in range(known - 1, end)]
        if state.forced is not None:
            samples[0], state.forced = state.forced, None
        kept = accepted_tokens(drafts, samples)
        del state.tokens[known:], state.digests[known:]  # the drafts' KV counts only where kept
        state.tokens.extend(kept)
        state.num_computed = known + len(kept) - 1
        return kept


@dataclass
class Run:
    outputs: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)

    def tokens(self, req_id: str) -> list[int]:
        return [t for o in self.outputs[req_id] for t in o.new_token_ids]

    def final(self, req_id: str) -> EngineCoreOutput:
        return self.outputs[req_id][-1]


def step(sched: Scheduler, runner: FakeRunner, run: Run) -> SchedulerOutput:
    so = sched.schedule()
    run.steps.append(so)
    for out in sched.update_from_output(so, runner.execute(so)):
        assert not run.outputs.get(out.req_id) or not run.outputs[out.req_id][-1].finished
        run.outputs.setdefault(out.req_id, []).append(out)
    return so


def run_all(
    sched: Scheduler, runner: FakeRunner | None = None, run: Run | None = None, max_steps: int = 2000
) -> Run:
    """Step until nothing is left; outputs and steps are appended to `run` (or a new one)."""
    runner = runner or FakeRunner()
    run = run or Run()
    for _ in range(max_steps):
        if not (sched.has_unfinished_requests() or sched.has_finished_requests()):
            break
        step(sched, runner, run)
    assert not sched.has_unfinished_requests(), "requests never finished"
    return run


def assert_all_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert not sched.requests and not sched.running and not sched.waiting


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


# ---- budget, chunked prefill, admission -------------------------------------------------


def test_token_budget_and_chunked_prefill():
    sched = make_scheduler(budget=10)
    add(sched, "long", list(range(25)), max_tokens=3)
    add(sched, "short", list(range(50, 54)), max_tokens=3)
    runner, run = FakeRunner(), Run()
    assert step(sched, runner, run).num_scheduled_tokens == {"long": 10}
    assert step(sched, runner, run).num_scheduled_tokens == {"long": 10}
    # The last chunk (5) plus the short prompt (4) share the budget.
    assert step(sched, runner, run).num_scheduled_tokens == {"long": 5, "short": 4}
    assert step(sched, runner, run).num_scheduled_tokens == {"long": 1, "short": 1}  # decodes cost 1
    run_all(sched, runner, run)
    assert run.tokens("long") == expected_tokens(list(range(25)), 3)
    assert_all_free(sched)


def test_new_and_cached_request_data():
    sched = make_scheduler(budget=6)
    add(sched, "a", list(range(10)), max_tokens=2)
    runner, run = FakeRunner(), Run()
    so = step(sched, runner, run)
    (new,) = so.scheduled_new_reqs
    assert new.token_ids == list(range(10)) and new.num_prompt_tokens == 10
    assert new.num_computed_tokens == 0 and new.block_ids == ([0, 1],)
    so = step(sched, runner, run)
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert so.scheduled_cached_reqs.num_computed_tokens == [6]
    assert so.scheduled_cached_reqs.new_block_ids == [([2],)]
    so = step(sched, runner, run)  # decode of token 11 fits in block 2
    assert so.scheduled_cached_reqs.new_block_ids == [None]
    run_all(sched, runner, run)
    assert_all_free(sched)


def test_chunked_prefill_disabled_runs_whole_prompts():
    sched = make_scheduler(budget=10, chunked=False)
    add(sched, "a", list(range(8)), max_tokens=4)
    add(sched, "b", list(range(20, 28)), max_tokens=4)
    add(sched, "big", list(range(100, 111)))  # can never run whole: fails, does not block the queue
    runner, run = FakeRunner(), Run()
    assert step(sched, runner, run).num_scheduled_tokens == {"a": 8}  # b's 8 do not fit in 2
    assert step(sched, runner, run).num_scheduled_tokens == {"a": 1, "b": 8}
    run_all(sched, runner, run)
    assert run.final("big").finish_reason == FinishReason.ERROR
    assert "max_num_batched_tokens" in run.final("big").error
    assert run.final("b").finish_reason == FinishReason.LENGTH
    assert_all_free(sched)


def test_resumed_request_is_chunked_even_without_chunked_prefill():
    sched = make_scheduler(num_blocks=6, budget=10, chunked=False, caching=False)
    prompts = {"a": list(range(8)), "b": list(range(30, 38))}
    for i, (req_id, prompt) in enumerate(prompts.items()):
        add(sched, req_id, prompt, arrival=i, max_tokens=8, ignore_eos=True)
    run = run_all(sched)
    assert sched.num_preemptions > 0
    resumed = [n for so in run.steps for n in so.scheduled_new_reqs if len(n.token_ids) > 10]
    assert resumed  # longer than the budget: it came back in chunks
    for req_id, prompt in prompts.items():
        assert run.tokens(req_id) == expected_tokens(prompt, 8)
    assert_all_free(sched)


def test_max_num_seqs():
    sched = make_scheduler(max_seqs=2)
    for i in range(3):
        add(sched, f"r{i}", [i + 10] * 5, arrival=i, max_tokens=3)
    runner, run = FakeRunner(), Run()
    so = step(sched, runner, run)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert sched.num_running == 2 and sched.num_waiting == 1
    run_all(sched, runner, run)
    assert_all_free(sched)


def test_fcfs_head_of_line_waits_for_blocks():
    sched = make_scheduler(num_blocks=6, budget=64)
    add(sched, "a", list(range(12)), arrival=0, max_tokens=5)  # 3 blocks, then a 4th
    add(sched, "b", list(range(100, 112)), arrival=1, max_tokens=2)  # 3 blocks: 6 total, fits
    add(sched, "c", list(range(200, 212)), arrival=2, max_tokens=2)  # must wait
    add(sched, "d", [5], arrival=3, max_tokens=2)  # would fit, but c is first in line
    runner, run = FakeRunner(), Run()
    so = step(sched, runner, run)
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    assert [r.req_id for r in sched.waiting] == ["c", "d"]
    run_all(sched, runner, run)
    admitted = [new.req_id for so in run.steps for new in so.scheduled_new_reqs]
    assert admitted.index("c") < admitted.index("d")
    assert_all_free(sched)


# ---- prefix caching -------------------------------------------------------------------


def test_prefix_hits_skip_computed_tokens_and_are_reported():
    sched = make_scheduler()
    runner = FakeRunner()  # one fake KV cache across both requests, as on a real worker
    shared = list(range(16))
    add(sched, "a", shared + [90, 91], max_tokens=2)
    run = run_all(sched, runner)
    assert run.final("a").num_cached_tokens == 0
    add(sched, "b", shared + [70, 71, 72], max_tokens=2)
    so = step(sched, runner, run)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert so.num_scheduled_tokens == {"b": 3}
    run_all(sched, runner, run)
    assert run.final("b").num_cached_tokens == 16
    assert run.tokens("b") == expected_tokens(shared + [70, 71, 72], 2)
    assert sched.prefix_cache_hits == 16
    assert sched.prefix_cache_queries == 18 + 19
    assert_all_free(sched)


def test_whole_prompt_is_never_served_from_cache():
    sched = make_scheduler()
    runner, run = FakeRunner(), Run()
    prompt = list(range(12))  # exactly three blocks
    add(sched, "a", prompt, max_tokens=1)
    run_all(sched, runner, run)
    add(sched, "b", prompt, max_tokens=3)
    so = step(sched, runner, run)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"b": 4}
    run_all(sched, runner, run)
    assert run.tokens("b")[:1] == expected_tokens(prompt, 1)
    assert_all_free(sched)


@pytest.mark.parametrize("collide", [False, True])
def test_concurrent_shared_prefixes_are_correct(collide: bool, monkeypatch: pytest.MonkeyPatch):
    if collide:  # every block hash equal: only the content check stands between us and wrong KV
        monkeypatch.setattr(hashing, "hash_bytes", lambda data: b"collide")
    sched = make_scheduler(num_blocks=40, budget=16)
    runner = FakeRunner()
    base = list(range(30))
    prompts = {f"r{i}": base[: 10 + 4 * i] + [i] * (i + 1) for i in range(6)}
    for i, (req_id, prompt) in enumerate(prompts.items()):
        add(sched, req_id, prompt, arrival=i, max_tokens=6)
    run = run_all(sched, runner)
    for req_id, prompt in prompts.items():
        assert run.tokens(req_id) == expected_tokens(prompt, 6)
    assert sched.prefix_cache_hits > 0
    assert_all_free(sched)


# ---- preemption and capacity -----------------------------------------------------------


def test_preemption_under_a_tiny_pool_finishes_everything():
    prompts = {f"r{i}": [i * 7 + j for j in range(6 + i)] for i in range(6)}

    def workload(num_blocks: int) -> tuple[Scheduler, Run]:
        sched = make_scheduler(num_blocks=num_blocks, budget=16)
        for i, (req_id, prompt) in enumerate(prompts.items()):
            add(sched, req_id, prompt, arrival=i, max_tokens=12, ignore_eos=True)
        return sched, run_all(sched)

    roomy_sched, roomy = workload(64)
    tight_sched, tight = workload(8)
    assert roomy_sched.num_preemptions == 0 and tight_sched.num_preemptions > 0
    for req_id, prompt in prompts.items():
        assert tight.tokens(req_id) == roomy.tokens(req_id) == expected_tokens(prompt, 12)
        assert tight.final(req_id).finish_reason == FinishReason.LENGTH
    preempted = set().union(*(so.preempted_req_ids for so in tight.steps))
    assert preempted
    # A preempted request comes back as new, with its outputs so far.
    resumed = [
        n for so in tight.steps for n in so.scheduled_new_reqs if len(n.token_ids) > n.num_prompt_tokens
    ]
    assert resumed and all(n.token_ids[: n.num_prompt_tokens] == prompts[n.req_id] for n in resumed)
    assert_all_free(roomy_sched)
    assert_all_free(tight_sched)


def test_latest_arrival_is_preempted():
    sched = make_scheduler(num_blocks=4, budget=64)
    add(sched, "old", list(range(7)), arrival=0, max_tokens=10, ignore_eos=True)  # 2 blocks, grows
    add(sched, "new", list(range(50, 57)), arrival=1, max_tokens=10, ignore_eos=True)
    runner, run = FakeRunner(), Run()
    step(sched, runner, run)  # both admitted: 4 blocks
    so = step(sched, runner, run)  # tokens 8: both need a third block
    assert so.preempted_req_ids == set()
    so = step(sched, runner, run)
    assert "new" in so.preempted_req_ids and "old" in so.num_scheduled_tokens
    run_all(sched, runner, run)
    assert_all_free(sched)


def test_requests_larger_than_the_cache_end_clearly():
    sched = make_scheduler(num_blocks=3)
    add(sched, "huge", list(range(13)))  # the prompt needs 4 blocks: an error, at once
    add(sched, "grow", list(range(10)), max_tokens=50, ignore_eos=True)  # outgrows the cache
    run = run_all(sched)
    assert run.final("huge").finish_reason == FinishReason.ERROR
    assert "KV cache" in run.final("huge").error and run.tokens("huge") == []
    assert run.final("grow").finish_reason == FinishReason.LENGTH
    assert len(run.tokens("grow")) == 3  # 12 tokens fill the 3 blocks; the 13th needs a 4th
    assert_all_free(sched)


# ---- stop conditions ---------------------------------------------------------------------


def fixed_runner(*tokens: int) -> FakeRunner:
    """A runner that samples the given tokens in order (then repeats the last)."""
    seq = list(tokens)
    return FakeRunner(token_fn=lambda _: seq.pop(0) if len(seq) > 1 else seq[0])


@pytest.mark.parametrize(
    ("params", "expect_tokens", "reason", "stop_reason"),
    [
        ({}, [7, 8, EOS], FinishReason.STOP, None),
        ({"ignore_eos": True, "max_tokens": 4}, [7, 8, EOS, 9], FinishReason.LENGTH, None),
        ({"stop_token_ids": [8]}, [7, 8], FinishReason.STOP, 8),
        ({"max_tokens": 2}, [7, 8], FinishReason.LENGTH, None),
    ],
)
def test_stop_conditions(params, expect_tokens, reason, stop_reason):
    sched = make_scheduler()
    params.setdefault("max_tokens", 10)
    add(sched, "r", [1, 3, 4], **params)
    run = run_all(sched, fixed_runner(7, 8, EOS, 9, 9))
    assert run.tokens("r") == expect_tokens
    final = run.final("r")
    assert final.finish_reason == reason and final.stop_reason == stop_reason
    assert final.num_prompt_tokens == 3
    assert_all_free(sched)


def test_max_model_len_caps_output():
    sched = make_scheduler(max_len=8)
    add(sched, "r", list(range(5)), max_tokens=None, ignore_eos=True)
    add(sched, "full", list(range(8)), max_tokens=5, ignore_eos=True)  # prompt fills the context
    run = run_all(sched)
    assert len(run.tokens("r")) == 3 and run.final("r").finish_reason == FinishReason.LENGTH
    assert len(run.tokens("full")) == 1 and run.final("full").finish_reason == FinishReason.LENGTH
    assert_all_free(sched)


def test_add_request_validates_and_takes_prebuilt_requests():
    sched = make_scheduler(max_len=16)
    with pytest.raises(InvalidRequestError):
        add(sched, "empty", [])
    with pytest.raises(InvalidRequestError):
        add(sched, "long", list(range(17)))
    runner = FakeRunner()
    for req_id in ("a", "b"):
        sched.add_request(Request(req_id, list(range(9)), SamplingParams(max_tokens=2), [EOS], 16))
        run = run_all(sched, runner)
    assert run.final("b").num_cached_tokens == 8  # hashed by the scheduler's hasher
    add(sched, "dup", [1])
    with pytest.raises(ValueError):
        add(sched, "dup", [1])
    sched.abort_requests("dup")
    assert_all_free(sched)


# ---- abort -------------------------------------------------------------------------------


def test_abort_frees_blocks_and_tells_workers():
    sched = make_scheduler(budget=8)
    add(sched, "run", list(range(10)), max_tokens=20)
    add(sched, "wait", list(range(10)), max_tokens=20)
    runner, run = FakeRunner(), Run()
    step(sched, runner, run)
    so = sched.schedule()
    out = runner.execute(so)
    assert sched.kv_cache_manager.num_free_blocks < sched.kv_cache_manager.num_blocks
    sched.abort_requests(["run", "wait", "unknown"])  # between schedule and update
    assert sched.update_from_output(so, out) == []  # results of aborted requests are dropped
    assert_all_free(sched)
    assert not sched.has_unfinished_requests() and sched.has_finished_requests()
    so = step(sched, runner, run)
    assert so.finished_req_ids == {"run", "wait"} and so.is_empty
    assert "run" not in runner.states
    assert not sched.has_finished_requests()


# ---- connector seam ----------------------------------------------------------------------


class FakeConnector:
    """Scheduler half: claims `external` tokens of every new request, loaded async or not."""

    load_failure_policy = LoadFailurePolicy.FAIL

    def __init__(self, external: int = 0, load_async: bool = False, delay_free: bool = False):
        self.external, self.load_async, self.delay_free = external, load_async, delay_free
        self.calls: list[tuple] = []

    def request_added(self, request):
        self.calls.append(("added", request.req_id))

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.req_id, num_computed_tokens))
        return self.external, self.load_async

    def update_state_after_alloc(self, request, block_ids, num_external):
        self.calls.append(("alloc", request.req_id, num_external, block_ids))

    def build_connector_meta(self, scheduler_output):
        self.calls.append(("meta", scheduler_output.total_num_scheduled_tokens))
        return {"num_tokens": scheduler_output.total_num_scheduled_tokens}

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.req_id, block_ids))
        return self.delay_free, {"remote": request.req_id} if self.delay_free else None

    def update_connector_output(self, connector_output):
        self.calls.append(("output", connector_output))

    def release_kept(self, request_ids):
        self.calls.append(("release", list(request_ids)))


def test_connector_sync_load_counts_as_computed():
    conn = FakeConnector(external=8)
    sched = make_scheduler(connector=conn)
    runner, run = FakeRunner(), Run()
    assert step(sched, runner, run).kv_connector_metadata == {"num_tokens": 0}  # empty steps too
    add(sched, "r", list(range(10)), max_tokens=2)
    so = sched.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and so.num_scheduled_tokens == {"r": 2}
    runner.preload(list(range(10)), new.block_ids[0], 8)  # the worker half loads in the forward
    sched.update_from_output(so, runner.execute(so))
    assert ("alloc", "r", 8, ([0, 1, 2],)) in conn.calls
    run_all(sched, runner, run)
    assert all(so.kv_connector_metadata is not None for so in run.steps)
    assert ("finished", "r", ([0, 1, 2],)) in conn.calls and sched.connector_hit_tokens == 8
    assert_all_free(sched)


def test_connector_async_load_then_delayed_free():
    conn = FakeConnector(external=100, load_async=True, delay_free=True)
    sched = make_scheduler(connector=conn)
    add(sched, "r", list(range(10)), max_tokens=1)
    runner, run = FakeRunner(), Run()
    so = step(sched, runner, run)
    assert so.is_empty and sched.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert ("alloc", "r", 9, ([0, 1, 2],)) in conn.calls  # clamped: the last token is computed
    assert step(sched, runner, run).is_empty  # still loading
    runner.kv_output = KVConnectorOutput(finished_recving={"r"})
    step(sched, runner, run)  # the load is reported
    runner.preload(list(range(10)), [0, 1, 2], 9)
    so = step(sched, runner, run)
    assert so.num_scheduled_tokens == {"r": 1} and so.scheduled_new_reqs[0].num_computed_tokens == 9
    assert run.final("r").finished and run.final("r").kv_transfer_params == {"remote": "r"}
    assert run.final("r").num_cached_tokens == 9
    assert sched.kv_cache_manager.num_free_blocks < sched.kv_cache_manager.num_blocks  # held
    assert sched.has_pending_kv_transfers()
    runner.kv_output = KVConnectorOutput(finished_sending={"r"})
    step(sched, runner, run)
    assert not sched.has_pending_kv_transfers()
    # Sending reported in the step the request finishes: blocks are freed at once.
    add(sched, "s", list(range(50, 55)), max_tokens=1)
    conn.external = 0
    runner.kv_output = KVConnectorOutput(finished_sending={"s"})
    step(sched, runner, run)
    assert run.final("s").finished and not sched.has_pending_kv_transfers()
    assert_all_free(sched)


class NotAnOutput:
    finished_recving = {"r"}  # the right field names on the wrong type


@pytest.mark.parametrize(
    "bad",
    [
        {"finished_recving": {"r"}},
        NotAnOutput(),
        KVConnectorOutput(finished_recving=["r"]),
        KVConnectorOutput(finished_sending={1}),
        KVConnectorOutput(invalid_block_ids={"3"}),
        KVConnectorOutput(stats={"bytes": 1}),
    ],
)
def test_a_malformed_connector_output_raises(bad):
    conn = FakeConnector(external=100, load_async=True)
    sched = make_scheduler(connector=conn)
    add(sched, "r", list(range(10)), max_tokens=1)
    runner, run = FakeRunner(), Run()
    step(sched, runner, run)
    runner.kv_output = bad
    with pytest.raises(TypeError, match="KVConnectorOutput"):
        step(sched, runner, run)
    assert sched.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_async_load_follows_the_policy(policy):
    conn = FakeConnector(external=8, load_async=True)
    sched = make_scheduler(connector=conn, kv_load_failure_policy=policy)
    add(sched, "r", list(range(10)), max_tokens=2)
    runner, run = FakeRunner(), Run()
    step(sched, runner, run)
    conn.external = 0  # no remote KV the second time
    runner.kv_output = KVConnectorOutput(finished_recving={"r"}, failed_recving={"r"})
    step(sched, runner, run)
    run_all(sched, runner, run)
    final = run.final("r")
    if policy == "fail":
        assert final.finish_reason == FinishReason.ERROR and final.error
    else:
        assert run.tokens("r") == expected_tokens(list(range(10)), 2)
        assert final.num_cached_tokens == 0  # the failed load does not count
    assert_all_free(sched)


def test_abort_while_receiving_waits_for_the_transfer():
    conn = FakeConnector(external=8, load_async=True)
    sched = make_scheduler(connector=conn)
    add(sched, "r", list(range(10)))
    runner, run = FakeRunner(), Run()
    step(sched, runner, run)
    sched.abort_requests(["r"])
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks < kv.num_blocks  # the load may still write into them
    runner.kv_output = KVConnectorOutput(finished_recving={"r"})
    step(sched, runner, run)
    assert_all_free(sched)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_invalid_blocks_follow_the_policy(policy):
    conn = FakeConnector(external=8)
    sched = make_scheduler(connector=conn, kv_load_failure_policy=policy, budget=1)
    add(sched, "r", list(range(10)), max_tokens=2)
    runner, run = FakeRunner(), Run()
    so = sched.schedule()
    block_ids = so.scheduled_new_reqs[0].block_ids[0]
    runner.preload(list(range(10)), block_ids, 8)
    out = runner.execute(so)
    out.kv_connector_output = KVConnectorOutput(invalid_block_ids={block_ids[0]})
    conn.external = 0
    outputs = sched.update_from_output(so, out)
    run = run_all(sched, runner)
    if policy == "fail":  # reported at once, with no token from the failed step
        (final,) = outputs
        assert final.finish_reason == FinishReason.ERROR and final.new_token_ids == []
    else:
        assert outputs == []
        assert "r" in run.steps[0].preempted_req_ids
        assert run.tokens("r") == expected_tokens(list(range(10)), 2)
    assert_all_free(sched)


# ---- forced first token ------------------------------------------------------------------


class ForcingConnector(FakeConnector):
    """Forces each request's first token, like the NixlConnector with the prefiller's token."""

    def __init__(self, first: int, **kw):
        super().__init__(**kw)
        self.first = first

    def request_added(self, request):
        super().request_added(request)
        request.force_first_token(self.first)


def test_forced_first_token_is_the_first_output_and_counts():
    prompt = list(range(10))
    sched = make_scheduler(connector=ForcingConnector(7, external=8, load_async=True))
    add(sched, "r", prompt, max_tokens=4)
    runner, run = FakeRunner(), Run()
    step(sched, runner, run)
    runner.kv_output = KVConnectorOutput(finished_recving={"r"})
    step(sched, runner, run)
    runner.preload(prompt, [0, 1, 2], 9)
    run_all(sched, runner, run)
    (new,) = [n for so in run.steps for n in so.scheduled_new_reqs]
    assert new.forced_token_id == 7
    assert run.tokens("r") == [7, *expected_tokens([*prompt, 7], 3)]  # max_tokens counts it
    assert run.final("r").finish_reason == FinishReason.LENGTH
    assert_all_free(sched)


@pytest.mark.parametrize(
    ("params", "drafted"),
    [
        ({}, True),
        ({"frequency_penalty": 0.5}, False),  # the second token's sample needs the first's counts
        ({"min_tokens": 2}, False),
        ({"prompt_logprobs": 1}, False),
        ({"max_tokens": 1}, False),
    ],
)
def test_a_forced_first_token_is_a_draft_of_the_step_that_ends_the_prompt(params, drafted):
    """The forced token's row is computed with the prompt's last one (a P/D decoder: after
    the pulled KV), so that step outputs it and the next token: the request's own first
    token one step sooner. Not where the next token's sample needs more than its logits."""
    prompt = list(range(10))
    sched = make_scheduler(connector=ForcingConnector(7, external=8, load_async=True))
    add(sched, "r", prompt, **{"max_tokens": 4, **params})
    runner, run = FakeRunner(), Run()
    step(sched, runner, run)
    runner.kv_output = KVConnectorOutput(finished_recving={"r"})
    step(sched, runner, run)
    runner.preload(prompt, [0, 1, 2], 8)
    first = step(sched, runner, run)
    assert [n.req_id for n in first.scheduled_new_reqs] == ["r"]
    assert first.scheduled_spec_token_ids == ({"r": [7]} if drafted else {})
    assert first.num_scheduled_tokens["r"] == (3 if drafted else 2)
    assert run.outputs["r"][0].new_token_ids == ([7, next_token([*prompt, 7])] if drafted else [7])
    run_all(sched, runner, run)
    tokens = run.tokens("r")
    assert tokens == [7, *expected_tokens([*prompt, 7], len(tokens) - 1)]
    assert len(tokens) == (1 if params.get("max_tokens") == 1 else 4)
    assert_all_free(sched)


def test_forced_first_token_goes_through_the_stop_checks():
    sched = make_scheduler(connector=ForcingConnector(EOS))
    add(sched, "eos", list(range(5)))
    run = run_all(sched)
    assert run.tokens("eos") == [EOS] and run.final("eos").finish_reason == FinishReason.STOP
    sched = make_scheduler(connector=ForcingConnector(9))
    add(sched, "stop", list(range(5)), stop_token_ids=[9])
    run = run_all(sched)
    assert run.tokens("stop") == [9] and run.final("stop").stop_reason == 9
    assert_all_free(sched)


def test_forced_first_token_survives_preemption_only_until_it_is_output():
    sched = make_scheduler(num_blocks=6, budget=10, caching=False, connector=ForcingConnector(5))
    prompts = {"a": list(range(8)), "b": list(range(30, 38))}
    for i, (req_id, prompt) in enumerate(prompts.items()):
        add(sched, req_id, prompt, arrival=i, max_tokens=8, ignore_eos=True)
    run = run_all(sched)
    assert sched.num_preemptions > 0
    news = [n for so in run.steps for n in so.scheduled_new_reqs]
    assert any(len(n.token_ids) > n.num_prompt_tokens for n in news)  # resumed with outputs
    for n in news:
        resumed = len(n.token_ids) > n.num_prompt_tokens
        assert n.forced_token_id == (None if resumed else 5)
    for req_id, prompt in prompts.items():
        assert run.tokens(req_id) == [5, *expected_tokens([*prompt, 5], 7)]
    assert_all_free(sched)
