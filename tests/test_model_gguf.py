"""The embedded SmolLM2 GGUF: our model against transformers' Llama on the same weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvferry.kv.spec import Layout
from kvferry.model.loader import gguf_state_dict, load_model
from kvferry.model.loader.gguf_dequant import dequantize
from kvferry.model.loader.gguf_reader import GGUFFile
from kvferry.model.loader.gguf_weights import hf_name, unpermute_rope
from kvferry.model.resolve import resolve_model_config
from kvferry.model.tokenizer import load_tokenizer
from tests.fixtures.paged import Chunk, PagedDriver
from tests.fixtures.tiny_gguf import write_tiny_gguf

ATOL = 5e-4  # logits reach ~40 here


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path):
    from transformers import LlamaForCausalLM

    cfg = resolve_model_config(str(smollm2_gguf), dtype="float32")  # the reference's
    ours = load_model(cfg)
    ref = LlamaForCausalLM(cfg.hf_config).eval()
    missing, unexpected = ref.load_state_dict(gguf_state_dict(smollm2_gguf), strict=False)
    assert unexpected == [] and missing == ["lm_head.weight"]  # tied to the embedding
    ref.tie_weights()
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    return cfg, ours, ref, load_tokenizer(cfg)


def _prompts(tok) -> list[list[int]]:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [tok(chat).input_ids, tok("The quick brown fox").input_ids]


def test_logits_match_hf(smollm2) -> None:
    _, ours, ref, tok = smollm2
    prompts = _prompts(tok)
    driver = PagedDriver(ours, num_blocks=16, block_size=16, layout=Layout.HND, seed=4)
    out = driver.step([Chunk(str(i), p) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(out[str(i)], expected, atol=ATOL, rtol=0)


def test_greedy_continuation_matches_hf(smollm2) -> None:
    _, ours, ref, tok = smollm2
    prompts = _prompts(tok)
    driver = PagedDriver(ours, num_blocks=16, block_size=16, seed=5)
    out = driver.step([Chunk(str(i), p) for i, p in enumerate(prompts)])
    generated = [[int(out[str(i)][-1].argmax())] for i in range(len(prompts))]
    for _ in range(7):
        out = driver.step([Chunk(str(i), [g[-1]], decode=True) for i, g in enumerate(generated)])
        for i, g in enumerate(generated):
            g.append(int(out[str(i)][-1].argmax()))
    for prompt, tokens in zip(prompts, generated, strict=True):
        with torch.no_grad():
            expected = ref.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None
            )
        assert tokens == expected[0, len(prompt) :].tolist()
    assert tok.decode(generated[0]).startswith("The capital of France is Paris")


def test_unpermute_inverts_llama_cpp_permute() -> None:
    heads, head_dim, hidden = 3, 8, 5
    weight = torch.randn(heads * head_dim, hidden)
    # llama.cpp: per head, interleave the first and second halves of the rows
    permuted = weight.reshape(heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(weight.shape)
    torch.testing.assert_close(unpermute_rope(permuted, heads), weight)


def test_reader_index(smollm2_gguf: Path) -> None:
    gguf = GGUFFile(smollm2_gguf)
    assert gguf.fields["general.architecture"] == "llama"
    assert len(gguf.fields["tokenizer.ggml.tokens"]) == 49152
    assert gguf.strings("tokenizer.ggml.tokens")[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    names = {hf_name(t.name) for t in gguf.tensors}
    assert "model.layers.29.mlp.down_proj.weight" in names and "lm_head.weight" not in names
    embed = next(t for t in gguf.tensors if t.name == "token_embd.weight")
    assert embed.shape == (49152, 576) and gguf.dequantize(embed).shape == (49152, 576)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_dequantize_matches_gguf_py(qtype: str) -> None:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    from gguf.quants import quantize

    kind = GGMLQuantizationType[qtype]
    values = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    packed = quantize(values, kind)
    expected = gguf_dequantize(packed, kind).astype(np.float32)
    ours = dequantize(np.ascontiguousarray(packed).view(np.uint8).reshape(-1), int(kind), (6, 64))
    assert torch.equal(ours, torch.from_numpy(expected))


def _reference(hf_config, state_dict: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    ref.load_state_dict(state_dict, strict=False)
    if hf_config.tie_word_embeddings:
        ref.tie_weights()
    return ref


@pytest.mark.parametrize("quantize", [False, True])
def test_tiny_gguf_matches_its_source(tiny_model: Path, tmp_path: Path, quantize: bool) -> None:
    """Our GGUF path (metadata, names, llama q/k order, Q8_0) on all three tiny archs."""
    from safetensors.torch import load_file

    path = write_tiny_gguf(tiny_model, tmp_path / "tiny.gguf", quantize=quantize)
    cfg = resolve_model_config(str(path), dtype="float32")
    source = resolve_model_config(str(tiny_model), dtype="float32")
    assert cfg.architecture == source.architecture and cfg.num_layers == source.num_layers
    assert cfg.hf_config.tie_word_embeddings == source.hf_config.tie_word_embeddings
    weights = gguf_state_dict(path) if quantize else load_file(str(tiny_model / "model.safetensors"))
    ref = _reference(cfg.hf_config, weights)
    prompt = [5, 9, 13, 200, 31, 77, 8, 41, 42]
    driver = PagedDriver(load_model(cfg), num_blocks=16, block_size=4, seed=6)
    out = driver.step([Chunk("x", prompt)])["x"]
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=0)


def test_gguf_without_vocab_size_or_tokens_is_a_load_error(tmp_path: Path) -> None:
    """No `<arch>.vocab_size` and no tokenizer tokens to count: a ModelLoadError naming
    the key, not a TypeError from int(None)."""
    import gguf

    from kvferry.errors import ModelLoadError
    from kvferry.model.loader.gguf_config import gguf_model_info

    path = tmp_path / "no-vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="lacks metadata key 'llama.vocab_size'"):
        gguf_model_info(path)
