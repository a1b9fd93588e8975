"""Speculative decoding through real servers: `kvferry serve --speculative-config` and a
drafting P/D decoder behind `kvferry proxy` (real NIXL agents, real HTTP) answer, streamed
and not, what a plain colocated server answers; the servers count kept drafts, and every
pool ends full."""

from __future__ import annotations

import json
from pathlib import Path

from tests.pd_support import ServerSpec, complete, nixl, proxying, serving, wait_idle
from tests.test_spec_decode import LOOPING

DRAFTING = ("--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3}))


def test_drafting_servers_answer_as_a_plain_one(tiny_llama: Path, tmp_path: Path) -> None:
    specs = {
        "plain": ServerSpec(None),
        "drafting": ServerSpec(None, args=DRAFTING),
        "p": ServerSpec(nixl("producer")),
        "d": ServerSpec(nixl("consumer"), layout="HND", args=DRAFTING),
    }
    with (
        serving(tiny_llama, tmp_path, specs) as servers,
        proxying({"pd": (servers["p"], servers["d"])}, tmp_path) as urls,
    ):
        for prompt in LOOPING:
            for stream in (False, True):
                want = complete(servers["plain"].url, prompt, 40, stream=False)
                for url in (servers["drafting"].url, urls["pd"]):
                    got = complete(url, prompt, 40, stream=stream)
                    assert (got.text, got.token_ids) == (want.text, want.token_ids), (url, stream)
        for name in ("drafting", "d"):
            metrics = wait_idle(servers[name])
            assert metrics["spec_decode_num_accepted_tokens"] > 0, name
        for name in ("plain", "p"):
            wait_idle(servers[name])
