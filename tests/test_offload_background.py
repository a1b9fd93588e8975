"""Saves run in the background: the request generates while its saves are stuck, and its
blocks stay held (delay_free) until the saves complete; identical prompts save once."""

import threading

from kvferry.connector.offload.connector import OffloadConnector
from kvferry.connector.offload.worker_side import OffloadWorker
from tests.engine_helpers import assert_pool_full, make_llm
from tests.offload_support import GREEDY, LONG, evict_device_cache, offload_config, sched_half, tokens


class _GatedWorker(OffloadWorker):
    """Saves wait for the test to open the gate (one gate per worker: uniproc only)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gate = threading.Event()

    def _save(self, batch, instance_id, staged_rows=None):
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        super()._save(batch, instance_id, staged_rows)


class GatedOffload(OffloadConnector):
    worker_class = _GatedWorker


def test_generation_goes_on_while_saves_are_pending_and_blocks_wait_for_them(tiny_llama):
    transfer = offload_config("fail", "GatedOffload", __name__, dram_blocks=64)
    llm = make_llm(tiny_llama, kv_transfer=transfer)
    worker = llm.engine.executor.worker.runner.connector.worker
    llm.engine.add_request(llm.inputs.process("r", LONG, GREEDY))
    generated = []
    while not generated or generated[-1].finish_reason is None:
        generated += [o for o in llm.engine.step() if o.new_token_ids]
    assert sum(len(o.new_token_ids) for o in generated) == GREEDY.max_tokens  # all while saves wait
    for _ in range(3):
        llm.engine.step()
    stats = llm.stats()
    assert llm.engine.has_unfinished_requests() and stats.num_free_blocks < stats.num_blocks  # held
    worker.gate.set()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert_pool_full(llm)
    assert sched_half(llm).totals["offload_saved_blocks"] == 7


def test_identical_prompts_in_one_batch_are_saved_once(tiny_llama):
    llm = make_llm(tiny_llama, kv_transfer=offload_config(dram_blocks=64))
    first = llm.generate([LONG, LONG], GREEDY)
    assert sched_half(llm).totals["offload_saved_blocks"] == 7
    evict_device_cache(llm)
    second = llm.generate([LONG, LONG], GREEDY)
    assert tokens(first) == tokens(second) and tokens(first)[0] == tokens(first)[1]
    assert [o.num_cached_tokens for o in second] == [112, 112]
    assert sched_half(llm).totals["offload_saved_blocks"] == 7
    assert_pool_full(llm)
