"""KV cache groups from the layers' own specs: Gemma 3's sliding and full layers share
tensors (hybrid allocation), block ids never collide across groups, a sliding-window
group holds only what its window sees, and the same KV memory admits more concurrent
long requests than the same model forced to full attention (counted by the scheduler)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvferry.config import CacheConfig, SchedulerConfig
from kvferry.errors import ConfigError
from kvferry.kv.allocate import allocate_kv_caches, build_kv_cache_config
from kvferry.kv.spec import (
    AttentionLayerKV,
    FullAttentionSpec,
    LatentAttentionSpec,
    SlidingWindowSpec,
    latent_head_size,
)
from kvferry.messages.engine_core import EngineCoreRequest
from kvferry.messages.model_runner import ModelRunnerOutput
from kvferry.model.gemma3 import Gemma3ForCausalLM
from kvferry.sampling_params import SamplingParams
from kvferry.scheduler.scheduler import Scheduler
from tests.fixtures.tiny_hybrid import WINDOW, hybrid_config

BLOCK = 4
MODEL = SimpleNamespace(dtype=torch.float32)  # what build_kv_cache_config reads of a ModelConfig


def gemma3_layers(full_attention: bool = False) -> list[AttentionLayerKV]:
    """The tiny Gemma 3's layers as the model states them (no weights needed)."""
    config = hybrid_config("gemma3", vocab_size=64, eos_id=0)
    if full_attention:
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    return Gemma3ForCausalLM(config).kv_layers()


def kv_config(layers: list[AttentionLayerKV], budget_bytes: int = 1 << 20, num_blocks: int | None = None):
    cache = CacheConfig(block_size=BLOCK, num_gpu_blocks_override=num_blocks, enable_prefix_caching=False)
    return build_kv_cache_config(MODEL, cache, layers, budget_bytes)


def test_gemma3_groups_share_tensors_one_layer_of_each_group() -> None:
    config = kv_config(gemma3_layers())
    specs = [type(g.spec) for g in config.groups]
    assert specs == [SlidingWindowSpec, SlidingWindowSpec, FullAttentionSpec]
    assert all(len(g.layer_names) == 2 for g in config.groups)
    assert config.groups[0].spec.sliding_window == WINDOW
    # 6 layers in 2 tensors, each shared by one layer of every group
    assert len(config.tensors) == 2
    assert [len(t.shared_by) for t in config.tensors] == [3, 3]
    for tensor in config.tensors:
        assert sorted(config.group_of(name) for name in tensor.shared_by) == [0, 1, 2]
    caches = allocate_kv_caches(config, "cpu")
    assert len(caches) == 6 and len({t.data_ptr() for t in caches.values()}) == len(config.tensors)


def test_full_attention_keeps_one_group_and_one_tensor_per_layer() -> None:
    budget = 100 * 6 * 1024  # 100 blocks of 6 layers' 1 KiB pages
    config = kv_config(gemma3_layers(full_attention=True), budget)
    assert len(config.groups) == 1 and len(config.tensors) == 6 and config.num_blocks == 100
    hybrid = kv_config(gemma3_layers(), budget)
    assert hybrid.num_blocks == 3 * config.num_blocks  # a block spans 2 layers, not 6


def test_smaller_pages_are_padded_to_the_largest_and_unpaddable_ones_refused() -> None:
    layers = [AttentionLayerKV("a", 2, 16), AttentionLayerKV("b", 2, 32, sliding_window=8)]
    config = kv_config(layers)
    full, window = (config.groups[config.group_of(name)].spec for name in ("a", "b"))
    assert (full.head_size, full.head_padding) == (32, 16) and window.head_padding == 0
    assert full.page_size_bytes == window.page_size_bytes
    with pytest.raises(ConfigError, match="cannot be padded"):
        kv_config([AttentionLayerKV("a", 3, 16), AttentionLayerKV("b", 2, 32, sliding_window=8)])


def _request(req_id: str, num_prompt: int, max_tokens: int) -> EngineCoreRequest:
    prompt = [(7 * i + len(req_id)) % 50 + 1 for i in range(num_prompt)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineCoreRequest(req_id, prompt, params, 0.0)


def peak_running(layers: list[AttentionLayerKV], budget_bytes: int) -> tuple[int, int]:
    """Run 8 long requests (160 prompt tokens, chunked by 32, 64 generated) to the end
    under one KV budget; the most requests the scheduler ran at once, and its preemptions."""
    config = kv_config(layers, budget_bytes)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=64, enable_chunked_prefill=True),
        CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        config,
        512,
    )
    for i in range(8):
        sched.add_request(_request(f"r{i}", 160, 64), [0])
    peak = 0
    for _ in range(5000):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        peak = max(peak, len(sched.running))
        sched.update_from_output(so, _run(sched, so))
    assert not sched.has_unfinished_requests()
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    return peak, sched.num_preemptions


def _run(sched: Scheduler, so) -> ModelRunnerOutput:  # noqa: ANN001 - a SchedulerOutput
    """A model that samples token 1 whenever a request reaches the end of what it knows."""
    out = ModelRunnerOutput()
    for req_id in so.num_scheduled_tokens:
        request = sched.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens  # advanced by schedule()
        out.req_ids.append(req_id)
        out.sampled_token_ids.append([1] if done else [])
        out.logprobs.append(None)
    return out


def test_sliding_windows_admit_more_concurrent_long_requests_in_the_same_memory() -> None:
    budget = 1200 << 10  # 200 blocks of 6 full layers, 600 blocks of 2 layers
    hybrid_peak, hybrid_preemptions = peak_running(gemma3_layers(), budget)
    full_peak, full_preemptions = peak_running(gemma3_layers(full_attention=True), budget)
    # 224 tokens: 56 blocks of 6 layers (336 KiB) with full attention; with windows, 56
    # blocks for the full layers and about 7 per sliding group, of 2 layers (~140 KiB)
    assert hybrid_peak == 8 and full_peak <= 5
    assert full_preemptions > hybrid_preemptions


def test_a_gemma3_shaped_model_lives_in_four_tensors() -> None:
    """26 layers, every sixth full (22 sliding, 4 full): groups of 4 layers, 4 tensors."""
    config = hybrid_config("gemma3", vocab_size=64, eos_id=0)
    config.num_hidden_layers = 26
    config.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]
    kv = kv_config(Gemma3ForCausalLM(config).kv_layers())
    assert [len(g.layer_names) for g in kv.groups] == [4, 4, 4, 4, 4, 2, 4]
    assert isinstance(kv.groups[-1].spec, FullAttentionSpec) and len(kv.tensors) == 4
    assert sorted(len(t.shared_by) for t in kv.tensors) == [6, 6, 7, 7]


@pytest.mark.parametrize("arch", ("gemma3", "gemma4", "qwen3_swa"))
def test_an_unknown_layer_type_is_refused_by_name(arch: str) -> None:
    """Checked before rope reads the types (it has no entry for an unknown one)."""
    from kvferry.errors import ModelLoadError
    from kvferry.model.registry import model_class

    config = hybrid_config(arch, vocab_size=64, eos_id=0)
    config.layer_types = ["chunked_attention"] + config.layer_types[1:]
    expected = (
        r"unsupported attention layer type 'chunked_attention'.*supported: full_attention, sliding_attention"
    )
    with pytest.raises(ModelLoadError, match=expected):
        model_class(config.architectures[0])(config)


def test_latent_layers_mix_with_sliding_window_layers_in_shared_tensors() -> None:
    """A model mixing latent attention (MLA rows of 40 values) with sliding-window layers:
    each kind keeps its own group and spec, the groups share tensors, and the smaller page
    (the latent one) is padded to the larger, its latent size unchanged."""
    layers = [
        AttentionLayerKV("mla0", 1, latent_head_size(40), latent_size=40),
        AttentionLayerKV("swa0", 2, 32, sliding_window=8),
        AttentionLayerKV("mla1", 1, latent_head_size(40), latent_size=40),
        AttentionLayerKV("swa1", 2, 32, sliding_window=8),
    ]
    config = kv_config(layers)
    latent, window = (config.groups[config.group_of(name)].spec for name in ("mla0", "swa0"))
    assert isinstance(latent, LatentAttentionSpec) and latent.latent_size == 40
    assert isinstance(window, SlidingWindowSpec) and not isinstance(window, LatentAttentionSpec)
    assert (latent.head_size, latent.head_padding) == (64, 44) and window.head_padding == 0
    assert latent.page_size_bytes == window.page_size_bytes
    assert len(config.tensors) == 2 and all(len(t.shared_by) == 2 for t in config.tensors)
