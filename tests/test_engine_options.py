"""One way from user options to an EngineConfig: EngineOptions, whose defaults are the config
dataclasses' own, reached by both `LLM(model, **options)` and the command line."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path

import pytest

from kvferry.config import (
    CacheConfig,
    EngineConfig,
    EngineOptions,
    ExecutorKind,
    KVEventsConfig,
    KVTransferConfig,
    MLAForm,
    MLAForms,
    MoEParallel,
    ParallelConfig,
    SchedulerConfig,
    WeightQuantization,
)
from kvferry.engine.options import engine_config
from kvferry.entrypoints.cli import build_parser
from kvferry.entrypoints.engine_args import DEFAULT_MODEL, add_engine_args, engine_config_from_args
from kvferry.errors import ConfigError
from kvferry.kv.shared_pool import KVPoolSpec
from kvferry.kv.spec import KVAllocator, Layout


def from_cli(*argv: str) -> EngineConfig:
    return engine_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_no_option_gives_the_config_dataclasses_defaults(tiny_llama: Path):
    config = engine_config(EngineOptions(str(tiny_llama)))
    assert config == EngineConfig(model=config.model)
    assert (config.cache, config.scheduler, config.parallel) == (
        CacheConfig(),
        SchedulerConfig(),
        ParallelConfig(),
    )
    assert config.model.served_model_name == str(tiny_llama)


def test_the_command_line_states_no_default_of_its_own():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    defaults = {a.dest: a.default for a in parser._actions if a.dest != "help"}
    assert defaults.pop("model") == DEFAULT_MODEL
    flags = {"no_prefix_caching", "no_chunked_prefill", "enforce_eager"}  # store_true: off
    assert {k: v for k, v in defaults.items() if k not in flags} == dict.fromkeys(set(defaults) - flags)


def test_the_command_line_and_llm_options_build_the_same_config(tiny_llama: Path):
    plain = from_cli(str(tiny_llama))
    expected = engine_config(EngineOptions(str(tiny_llama), served_model_name=tiny_llama.name))
    assert plain == expected
    given = from_cli(
        str(tiny_llama),
        *("--block-size", "32", "--max-num-seqs", "8", "--max-num-batched-tokens", "256"),
        *("--kv-layout", "HND", "--kv-allocator", "elastic", "--executor", "multiproc", "-tp", "2"),
        *("--moe-parallel", "expert"),
        *("--seed", "7", "--dtype", "float32", "--quantization", "int4", "--kv-cache-memory", "1MiB"),
        *("--no-prefix-caching", "--no-chunked-prefill", "--enforce-eager", "--cpu-threads", "1"),
        *("--kv-cache-memory-fraction", "0.5", "--max-model-len", "64", "--served-model-name", "m"),
        *("--default-max-tokens", "12"),
    )
    options = EngineOptions(
        str(tiny_llama),
        dtype="float32",
        quantization="int4",
        max_model_len=64,
        served_model_name="m",
        block_size=32,
        kv_cache_bytes=1 << 20,
        kv_cache_memory_fraction=0.5,
        enable_prefix_caching=False,
        kv_layout="HND",
        kv_allocator="elastic",
        max_num_batched_tokens=256,
        max_num_seqs=8,
        enable_chunked_prefill=False,
        default_max_tokens=12,
        tensor_parallel_size=2,
        executor="multiproc",
        moe_parallel="expert",
        cpu_threads=1,
        enforce_eager=True,
        seed=7,
    )
    assert given == engine_config(options)
    assert given.cache.layout is Layout.HND and given.cache.kv_allocator is KVAllocator.ELASTIC
    assert given.parallel.executor is ExecutorKind.MULTIPROC
    assert given.parallel.moe_parallel is MoEParallel.EXPERT
    assert given.model.quantization is WeightQuantization.INT4
    assert (given.scheduler.max_num_seqs, given.cache.block_size, given.seed) == (8, 32, 7)


def test_every_option_reaches_the_config(tiny_llama: Path):
    """Each EngineOptions field changed alone changes the EngineConfig it builds."""
    model = engine_config(EngineOptions(str(tiny_llama))).model
    base = EngineOptions(str(tiny_llama))
    changed = {
        "quantization": "int4",
        "block_size": 32,
        "kv_cache_bytes": 1 << 20,
        "kv_cache_memory_fraction": 0.5,
        "enable_prefix_caching": False,
        "kv_layout": "HND",
        "kv_allocator": "elastic",
        "max_num_batched_tokens": 256,
        "max_num_seqs": 8,
        "enable_chunked_prefill": False,
        "prefill_budget_with_decodes": 64,
        "default_max_tokens": 32,
        "tensor_parallel_size": 2,
        "executor": "multiproc",
        "moe_parallel": "expert",
        "cpu_cores": (0, 1),
        "cpu_threads": 1,
        "kv_transfer": KVTransferConfig(kv_connector="NixlConnector"),
        "capture": "always",
        "enforce_eager": True,
        "cache_dir": "/elsewhere",
        "seed": 7,
        "kv_events": KVEventsConfig(enable_kv_cache_events=True, publisher="zmq"),
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
    }
    checked_below = {"kv_memory_pool"}  # needs the elastic allocator
    resolved_by_the_model = {
        *("model", "dtype", "max_model_len", "served_model_name", "quantization", "mla_prefill", "mla_decode")
    }
    assert set(changed) | resolved_by_the_model | checked_below == {f.name for f in fields(EngineOptions)}
    for name, value in changed.items():
        if name in resolved_by_the_model:
            continue
        assert replace(base, **{name: value}).engine_config(model) != base.engine_config(model), name
    swapped = engine_config(EngineOptions(str(tiny_llama), mla_prefill="absorbed", mla_decode="decompressed"))
    assert swapped.model.mla_forms == MLAForms(prefill=MLAForm.ABSORBED, decode=MLAForm.DECOMPRESSED)
    assert swapped.model.mla_forms != model.mla_forms
    elastic = replace(base, kv_allocator="elastic")
    pooled = replace(elastic, kv_memory_pool=KVPoolSpec("kvferry-test-options", None))
    assert pooled.engine_config(model).cache.kv_memory_pool == KVPoolSpec("kvferry-test-options", None)


def test_options_are_checked():
    with pytest.raises(ConfigError, match="unknown KV layout"):
        EngineOptions("m", kv_layout="XYZ")
    with pytest.raises(ConfigError, match="unknown executor"):
        EngineOptions("m", executor="threads")
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
        with pytest.raises(ConfigError, match=f"{name} must be at least 1, not 0"):
            EngineOptions("m", **{name: 0}).engine_config(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="block_sise"):
        EngineOptions("m", block_sise=16)  # type: ignore[call-arg]


def test_quantization_none_means_unquantized(tiny_llama: Path):
    """vLLM's `LLM(model, quantization=None)`: no quantization, not an unknown mode."""
    options = EngineOptions(str(tiny_llama), quantization=None)  # type: ignore[arg-type]
    assert options.quantization is WeightQuantization.NONE
    assert engine_config(options).model.quantization is WeightQuantization.NONE
    with pytest.raises(ConfigError, match="unknown quantization 'int3'"):
        EngineOptions("m", quantization="int3")  # type: ignore[arg-type]
