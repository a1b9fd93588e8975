"""Helpers shared by the offload and MultiConnector tests (no tests here)."""

from __future__ import annotations

from pathlib import Path

import torch

from kvferry.config import KVTransferConfig
from kvferry.connector.offload.scheduler_side import OffloadScheduler
from kvferry.connector.offload.worker_side import OffloadWorker
from kvferry.engine.llm import LLM
from kvferry.sampling_params import SamplingParams
from tests.engine_helpers import PROMPT_TEXTS

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = " ".join(PROMPT_TEXTS)  # ~115 tokens: 7 full blocks of 16
LONG2 = " ".join(reversed(PROMPT_TEXTS))


def offload_config(
    policy: str = "fail", connector: str = "OffloadConnector", module: str | None = None, **extra
) -> KVTransferConfig:
    return KVTransferConfig(
        connector,
        kv_connector_module_path=module,
        kv_connector_extra_config=extra,
        kv_load_failure_policy=policy,
    )


def disk_extra(tmp_path: Path, dram_blocks: int, disk_blocks: int) -> dict:
    return {"dram_blocks": dram_blocks, "disk_dir": str(tmp_path / "tier"), "disk_blocks": disk_blocks}


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def sched_half(llm: LLM) -> OffloadScheduler:
    return llm.engine.connector.scheduler


def worker_half(llm: LLM) -> OffloadWorker:
    """The worker half of a uniproc engine."""
    return llm.engine.executor.worker.runner.connector.worker


def evict_device_cache(llm: LLM) -> None:
    assert llm.engine.scheduler.reset_prefix_cache(), "blocks still held: the pool is not idle"


def full_blocks_before_last(prompt_len: int, block_size: int = 16) -> int:
    """Tokens a cache can serve: whole blocks, never the block of the last prompt token."""
    return (prompt_len - 1) // block_size * block_size


def fill_with_noise(tensor: torch.Tensor, seed: int = 0) -> None:
    """Overwrite a uint8 buffer of float32 KV with finite N(0, 2) floats."""
    gen = torch.Generator().manual_seed(seed)
    floats = tensor.view(torch.float32)
    floats.copy_(torch.randn(floats.shape, generator=gen) * 2)


def noise_disk_payloads(worker: OffloadWorker, seed: int = 0) -> None:
    """Overwrite every slot's payload in the disk file, keeping its header intact."""
    disk = worker.disk
    gen = torch.Generator().manual_seed(seed)
    with open(disk.path, "r+b") as f:
        for slot in range(disk.num_slots):
            noise = (torch.randn(disk.slot_bytes // 4, generator=gen) * 2).numpy().tobytes()
            f.seek(disk.payload_offset(slot))
            f.write(noise)
