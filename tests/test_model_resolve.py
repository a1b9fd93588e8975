"""resolve_model_config and load_tokenizer: dirs, GGUF files, aliases, the HF cache, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvferry.errors import ModelLoadError
from kvferry.model.resolve import resolve_model_config
from kvferry.model.tokenizer import gguf_tokenizer_cache_dir, load_tokenizer


@pytest.fixture
def empty_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import huggingface_hub.constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def _fake_cached_repo(cache: Path, repo_id: str, source: Path) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123456789abcdef"
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    return snapshot


def test_resolve_dir(tiny_model: Path) -> None:
    cfg = resolve_model_config(str(tiny_model), max_model_len=4096, served_model_name="tiny")
    assert cfg.architecture in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
    assert cfg.served_model_name == "tiny"
    assert cfg.dtype == torch.float32
    assert cfg.max_model_len == 1024  # clamped to max_position_embeddings
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.num_layers == cfg.hf_config.num_hidden_layers
    assert cfg.eos_token_ids == (0, 2)  # <|endoftext|>, <|im_end|>
    assert cfg.gguf_file is None and cfg.local_dir == str(tiny_model)
    tok = load_tokenizer(cfg)
    assert tok.chat_template and tok.eos_token_id == 0
    assert len(tok) == cfg.vocab_size


def test_resolve_dir_options(tiny_qwen2: Path) -> None:
    cfg = resolve_model_config(str(tiny_qwen2), dtype="bfloat16", max_model_len=100)
    assert cfg.dtype == torch.bfloat16 and cfg.max_model_len == 100
    assert cfg.served_model_name == str(tiny_qwen2)
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.hf_config.tie_word_embeddings


def test_resolve_gguf_file(smollm2_gguf: Path) -> None:
    cfg = resolve_model_config(str(smollm2_gguf))
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.gguf_file == str(smollm2_gguf) and cfg.local_dir == str(smollm2_gguf.parent)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.head_dim == 64 and cfg.vocab_size == 49152 and cfg.max_model_len == 8192
    assert cfg.eos_token_ids == (2,)
    hf = cfg.hf_config
    assert hf.tie_word_embeddings and hf.intermediate_size == 1536
    assert hf.rope_parameters["rope_theta"] == 100000.0
    assert abs(hf.rms_norm_eps - 1e-5) < 1e-9


def test_alias_uses_embedded_gguf(
    smollm2_gguf: Path, empty_hf_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for alias in ("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        cfg = resolve_model_config(alias, max_model_len=2048)
        assert cfg.gguf_file == str(smollm2_gguf)
        assert cfg.served_model_name == alias and cfg.max_model_len == 2048
    monkeypatch.setenv("KVFERRY_CACHE_DIR", str(tmp_path / "kvcache"))
    converted, cached = load_tokenizer(cfg), load_tokenizer(cfg)  # the second comes from the cache
    assert (gguf_tokenizer_cache_dir(smollm2_gguf) / "tokenizer.json").is_file()
    messages = [{"role": "user", "content": "hi"}]
    for tok in (converted, cached):
        assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    sample = "Hello 12345 world\n\n  spaces <|im_start|>user"
    assert converted(sample).input_ids == cached(sample).input_ids


def test_hub_id_from_cache(tiny_qwen3: Path, empty_hf_cache: Path) -> None:
    snapshot = _fake_cached_repo(empty_hf_cache, "acme/tiny-qwen3", tiny_qwen3)
    cfg = resolve_model_config("acme/tiny-qwen3")
    assert cfg.local_dir == str(snapshot) and cfg.architecture == "Qwen3ForCausalLM"
    assert cfg.served_model_name == "acme/tiny-qwen3"


def test_missing_hub_id(empty_hf_cache: Path) -> None:
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        resolve_model_config("acme/does-not-exist")


@pytest.mark.parametrize("model", ["/no/such/dir", "no-such-model", "/no/such/file.gguf"])
def test_missing_paths(model: str, empty_hf_cache: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist|not in the local"):
        resolve_model_config(model)


def test_unsupported_architecture(tiny_llama: Path, tmp_path: Path) -> None:
    model_dir = shutil.copytree(tiny_llama, tmp_path / "gpt2ish")
    raw = json.loads((model_dir / "config.json").read_text())
    raw["architectures"] = ["FancyNewForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="FancyNewForCausalLM"):
        resolve_model_config(str(model_dir))


def test_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_config(str(tmp_path))
