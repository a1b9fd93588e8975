"""Elastic KV memory on CUDA (driver virtual memory management). Skipped without a GPU:
CI has none, so these have not run in CI."""

from __future__ import annotations

import pytest
import torch

from kvferry.kv.pages import PageChanges, blocks_per_page
from kvferry.kv.spec import FullAttentionSpec, KVAllocator, KVCacheConfig, KVCacheGroup, KVCacheTensor, Layout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_config(num_pages: int = 8) -> KVCacheConfig:
    from kvferry.kv.elastic_cuda import cuda_page_granularity

    spec = FullAttentionSpec(16, 8, 128, torch.float16)
    groups = (KVCacheGroup(spec, ("l0", "l1")),)
    per_page = blocks_per_page(groups, cuda_page_granularity(torch.device("cuda")))
    capacity = num_pages * per_page
    tensors = tuple(KVCacheTensor(spec.page_size_bytes * capacity, (name,)) for name in groups[0].layer_names)
    return KVCacheConfig(groups, tensors, Layout.NHD, capacity, capacity, KVAllocator.ELASTIC, per_page)


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_pages_are_mapped_zeroed_and_returned():
    from kvferry.kv.elastic_cuda import CudaElasticKVMemory

    config = cuda_config()
    before = free_bytes()
    memory = CudaElasticKVMemory(config, torch.device("cuda"))
    assert before - free_bytes() < memory.page_bytes  # reserving commits nothing
    memory.apply(PageChanges(mapped=(0, 2), full_sync=True))
    assert before - free_bytes() >= 2 * memory.page_bytes
    tensor = memory.kv_caches["l0"]
    block = 2 * config.blocks_per_page
    assert torch.count_nonzero(tensor[:, block]) == 0  # fresh pages read as zeros
    tensor[:, block].fill_(1.5)
    assert torch.all(tensor[:, block] == 1.5)
    memory.apply(PageChanges(unmapped=(2,)))
    assert before - free_bytes() < 2 * memory.page_bytes
    memory.apply(PageChanges(mapped=(2,)))
    assert torch.count_nonzero(tensor[:, block]) == 0
    memory.release()
    assert before - free_bytes() < memory.page_bytes


def test_greedy_identical_to_eager_on_cuda(tiny_llama):
    from dataclasses import replace

    from kvferry.engine.llm import LLM
    from kvferry.sampling_params import SamplingParams
    from tests.engine_helpers import PROMPT_TEXTS
    from tests.test_elastic_engine import build_llm

    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = []
    for allocator in (KVAllocator.EAGER, KVAllocator.ELASTIC):
        base = build_llm(tiny_llama, allocator, num_blocks=64, budget=48)
        base.engine.shutdown()
        llm = LLM.from_config(replace(base.config, device="cuda"))
        outputs.append([list(o.outputs[0].token_ids) for o in llm.generate(PROMPT_TEXTS, greedy)])
        llm.engine.shutdown()
    assert outputs[0] == outputs[1]
