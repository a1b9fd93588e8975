"""Helpers for engine-level tests: build engines on tiny models, HF greedy references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvferry.config import (
    CacheConfig,
    CaptureMode,
    CompilationConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    MLAForms,
    MoEParallel,
    ParallelConfig,
    SchedulerConfig,
    WeightQuantization,
)
from kvferry.engine.llm import LLM
from kvferry.kv.spec import Layout
from kvferry.model.resolve import resolve_model_config
from kvferry.spec_decode.config import SpeculativeConfig

PROMPT_TEXTS = [
    "the cat",
    "a dog sees the red ball in the morning",
    "my friend builds a long road near the house every day and the teacher reads a book",
    "the old man",
    "our team finds a bright star",
    "the engineer carries a heavy box before the rain and the children paint the blue sky at night "
    "while the captain opens the golden door of the ancient castle by the sea",
    "hello",
    "the queen writes a letter to the king because it is late",
    "a small bird follows the river",
    "the scientist explains the strange machine to a curious student in the kitchen after lunch",
]


def engine_config_of(
    model_dir: Path,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    budget: int = 2048,
    max_num_seqs: int = 64,
    prefix_caching: bool = True,
    chunked: bool = True,
    max_model_len: int = 512,
    seed: int = 0,
    kv_transfer: KVTransferConfig | None = None,
    tp: int = 1,
    executor: str = "uniproc",
    moe_parallel: MoEParallel = MoEParallel.TENSOR,
    enforce_eager: bool = False,
    # Eager unless a test is about the captured forward: it passes ALWAYS (asserting the
    # compiled path ran) or AUTO (the start-up measurement). Compiling costs seconds per engine.
    capture: CaptureMode = CaptureMode.NEVER,
    device: str = "cpu",
    quantization: WeightQuantization = WeightQuantization.NONE,
    kv_layout: Layout = CacheConfig.layout,
    kv_events: KVEventsConfig | None = None,
    mla_forms: MLAForms | None = None,
    cache_dir: Path | None = None,  # keeps --capture auto's decision across starts; None: nothing kept
    speculative: SpeculativeConfig | None = None,
) -> EngineConfig:
    """The EngineConfig make_llm builds (its keyword arguments), without an engine."""
    model = resolve_model_config(
        str(model_dir),
        dtype="float32",
        max_model_len=max_model_len,
        quantization=quantization,
        mla_forms=mla_forms,
    )
    config = EngineConfig(
        model=model,
        cache=CacheConfig(
            block_size=block_size,
            kv_cache_bytes=64 << 20,
            num_gpu_blocks_override=num_blocks,
            enable_prefix_caching=prefix_caching,
            layout=kv_layout,
        ),
        scheduler=SchedulerConfig(budget, max_num_seqs, chunked),
        parallel=ParallelConfig(tensor_parallel_size=tp, executor=executor, moe_parallel=moe_parallel),
        kv_transfer=kv_transfer or KVTransferConfig(),
        compilation=CompilationConfig(
            capture=capture,
            enforce_eager=enforce_eager,
            cache_dir=None if cache_dir is None else str(cache_dir),
        ),
        kv_events=kv_events or KVEventsConfig(),
        speculative=speculative or SpeculativeConfig(),
        device=device,
        seed=seed,
    )
    return config


def make_llm(model_dir: Path, **options: Any) -> LLM:
    """An engine on a tiny model; `options` as engine_config_of's."""
    return LLM.from_config(engine_config_of(model_dir, **options))


def tokenize_all(model_dir: Path, texts: list[str]) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(t) for t in texts]


@torch.inference_mode()
def hf_greedy_each(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers greedy generate, one prompt at a time (no padding effects)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        outs.append(out[0, len(p) :].tolist())
    return outs


def assert_pool_full(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks, (
        f"{stats.num_blocks - stats.num_free_blocks} blocks leaked"
    )
