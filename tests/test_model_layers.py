"""Layer math: TP sharding (ranks simulated in one process), rope, norm."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kvferry.cpu_features import native_half_precision
from kvferry.errors import ConfigError, ModelLoadError
from kvferry.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvferry.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kvferry.model.layers.norm import RMSNorm
from kvferry.model.layers.packed import PackedWeight
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.layers.rotary import RotaryEmbedding, inverse_frequencies


@dataclass(frozen=True)
class LocalTP(TPGroup):
    """A rank whose collectives do nothing: the test combines ranks' outputs itself."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _load(layer: torch.nn.Module, name: str, full: torch.Tensor, shard_id: object = None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, full, shard_id)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_column_and_row_parallel_compose(size: int) -> None:
    w1, b1, w2 = torch.randn(16, 8), torch.randn(16), torch.randn(8, 16)
    x = torch.randn(3, 8)
    expected = F.linear(F.linear(x, w1, b1), w2)
    total = torch.zeros(3, 8)
    for rank in range(size):
        tp = LocalTP(rank, size)
        col, row = ColumnParallelLinear(8, 16, True, tp), RowParallelLinear(16, 8, False, tp)
        _load(col, "weight", w1)
        _load(col, "bias", b1)
        _load(row, "weight", w2)
        total += row(col(x))
    torch.testing.assert_close(total, expected)


@pytest.mark.parametrize("size", [1, 2])
def test_merged_gate_up_shards(size: int) -> None:
    gate, up, x = torch.randn(12, 6), torch.randn(12, 6), torch.randn(2, 6)
    parts = []
    for rank in range(size):
        layer = MergedColumnParallelLinear(6, [12, 12], False, LocalTP(rank, size))
        _load(layer, "weight", gate, 0)
        _load(layer, "weight", up, 1)
        parts.append(layer(x).chunk(2, dim=-1))  # this rank's (gate, up) slices
    torch.testing.assert_close(torch.cat([p[0] for p in parts], -1), F.linear(x, gate))
    torch.testing.assert_close(torch.cat([p[1] for p in parts], -1), F.linear(x, up))


@pytest.mark.parametrize(("size", "kv_heads"), [(1, 2), (2, 2), (2, 4), (4, 2)])
def test_qkv_shards_by_head(size: int, kv_heads: int) -> None:
    heads, head_dim, hidden = 8, 4, 16
    wq, wk, wv = torch.randn(heads * head_dim, hidden), *torch.randn(2, kv_heads * head_dim, hidden)
    bq, bk, bv = torch.randn(heads * head_dim), *torch.randn(2, kv_heads * head_dim)
    x = torch.randn(3, hidden)
    full_k = F.linear(x, wk, bk).view(3, kv_heads, head_dim)
    qs = []
    for rank in range(size):
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, True, LocalTP(rank, size))
        for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            _load(layer, "weight", w, shard)
            _load(layer, "bias", b, shard)
        q, k, _ = layer.split_qkv(layer(x))
        qs.append(q)
        first, count = layer.kv_head_start, layer.num_kv_heads
        assert count == max(1, kv_heads // size)
        query_heads = range(rank * heads // size, (rank + 1) * heads // size)
        assert all(h // (heads // kv_heads) in range(first, first + count) for h in query_heads)
        torch.testing.assert_close(k.view(3, count, head_dim), full_k[:, first : first + count])
    torch.testing.assert_close(torch.cat(qs, -1), F.linear(x, wq, bq))


@pytest.mark.parametrize(("heads", "kv_heads", "size"), [(9, 3, 2), (6, 3, 2), (10, 5, 3), (12, 3, 2)])
def test_uneven_head_split_follows_kv_groups(heads: int, kv_heads: int, size: int) -> None:
    """KV heads in contiguous, nearly equal ranges; query heads with their KV head; o_proj
    reads exactly this rank's query heads, and the ranks' partial sums compose."""
    head_dim, hidden = 4, 12
    wq, wk, wv = torch.randn(heads * head_dim, hidden), *torch.randn(2, kv_heads * head_dim, hidden)
    wo, x = torch.randn(hidden, heads * head_dim), torch.randn(3, hidden)
    shards = [TPGroup(rank, size).heads(heads, kv_heads) for rank in range(size)]
    assert [s.kv_start for s in shards] == [sum(s.num_kv_heads for s in shards[:r]) for r in range(size)]
    assert sum(s.num_kv_heads for s in shards) == kv_heads
    assert max(s.num_kv_heads for s in shards) - min(s.num_kv_heads for s in shards) <= 1
    if (heads, kv_heads, size) == (9, 3, 2):
        assert [(s.num_heads, s.num_kv_heads) for s in shards] == [(6, 2), (3, 1)]
    qs, out = [], torch.zeros(3, hidden)
    for rank, shard in enumerate(shards):
        tp = LocalTP(rank, size)
        qkv = QKVParallelLinear(hidden, head_dim, heads, kv_heads, False, tp)
        for shard_id, w in (("q", wq), ("k", wk), ("v", wv)):
            _load(qkv, "weight", w, shard_id)
        q, k, _ = qkv.split_qkv(qkv(x))
        kv_rows = slice(shard.kv_start * head_dim, (shard.kv_start + shard.num_kv_heads) * head_dim)
        torch.testing.assert_close(k, F.linear(x, wk[kv_rows]))
        group = heads // kv_heads
        assert shard.q_start == shard.kv_start * group and shard.num_heads == shard.num_kv_heads * group
        o_proj = RowParallelLinear(
            heads * head_dim, hidden, False, tp, in_range=(shard.q_start * head_dim, q.shape[-1])
        )
        _load(o_proj, "weight", wo)
        qs.append(q)
        out += o_proj(q)
    full_q = F.linear(x, wq)
    torch.testing.assert_close(torch.cat(qs, -1), full_q)
    torch.testing.assert_close(out, F.linear(full_q, wo))


def test_kv_cache_config_per_rank_heads_and_agreed_blocks() -> None:
    from types import SimpleNamespace

    from kvferry.config import CacheConfig
    from kvferry.kv.allocate import allocate_kv_caches, build_kv_cache_config, with_num_blocks
    from kvferry.kv.spec import AttentionLayerKV

    model = SimpleNamespace(num_kv_heads=3, head_dim=8, dtype=torch.float32, max_model_len=64)
    cache = CacheConfig(block_size=4, kv_cache_bytes=1 << 16)

    def layers(heads: int) -> list[AttentionLayerKV]:
        return [AttentionLayerKV(name, heads, 8) for name in ("a", "b")]

    rank0, rank1 = (build_kv_cache_config(model, cache, layers(heads), 1 << 16) for heads in (2, 1))
    assert rank1.num_blocks == 2 * rank0.num_blocks  # fewer heads: the same bytes hold more
    agreed = with_num_blocks(rank1, rank0.num_blocks)
    assert agreed.groups == rank1.groups and agreed.num_blocks == rank0.num_blocks
    caches = allocate_kv_caches(agreed, "cpu")
    assert caches["a"].shape == (2, rank0.num_blocks, 4, 1, 8)
    with pytest.raises(ConfigError):
        with_num_blocks(rank0, rank1.num_blocks)
    with pytest.raises(ConfigError):
        build_kv_cache_config(model, cache, layers(0), 1 << 16)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_vocab_parallel_embedding_and_head(size: int) -> None:
    vocab, hidden = 11, 4  # 11 is not divisible by 2 or 3: the last shard is padded
    weight, ids, h = torch.randn(vocab, hidden), torch.tensor([0, 5, 10, 3]), torch.randn(2, hidden)
    embedded, logits = torch.zeros(4, hidden), []
    for rank in range(size):
        tp = LocalTP(rank, size)
        emb, head = VocabParallelEmbedding(vocab, hidden, tp), ParallelLMHead(vocab, hidden, tp)
        _load(emb, "weight", weight)
        _load(head, "weight", weight)
        embedded += emb(ids)
        logits.append(head(h))
    torch.testing.assert_close(embedded, weight[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], h @ weight.T)


def test_indivisible_sizes_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        ColumnParallelLinear(4, 6, False, TPGroup(0, 4))
    with pytest.raises(ConfigError):
        TPGroup(2, 2)
    with pytest.raises(ConfigError):
        QKVParallelLinear(16, 4, 8, 2, False, TPGroup(0, 3))


def test_wrong_checkpoint_shape_is_load_error() -> None:
    layer = ColumnParallelLinear(4, 6, False, TPGroup())
    with pytest.raises(ModelLoadError, match="shape"):
        _load(layer, "weight", torch.randn(6, 5))


def test_rmsnorm_fused_residual() -> None:
    norm = RMSNorm(8, eps=1e-6)
    norm.weight.data = torch.randn(8)
    x, res = torch.randn(3, 8), torch.randn(3, 8)
    out, new_res = norm(x, res)
    s = x + res
    torch.testing.assert_close(new_res, s)
    torch.testing.assert_close(out, norm.weight * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_rope_rotates_relative_positions() -> None:
    rope = RotaryEmbedding(16, 64, {"rope_type": "default", "rope_theta": 10000.0})
    q, k = torch.randn(1, 2, 16), torch.randn(1, 2, 16)

    def score(pq: int, pk: int) -> torch.Tensor:
        rq, _ = rope(torch.tensor([pq]), q, q)
        _, rk = rope(torch.tensor([pk]), k, k)
        return (rq * rk).sum(-1)

    torch.testing.assert_close(score(10, 3), score(30, 23), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(score(0, 0), (q * k).sum(-1))


def test_rope_scaling_frequencies() -> None:
    base = {"rope_type": "default", "rope_theta": 500000.0}
    default = inverse_frequencies(64, base)
    llama3 = inverse_frequencies(64, {**base, "rope_type": "llama3", "factor": 8.0} | _LLAMA3)
    assert torch.equal(llama3[:4], default[:4])  # high frequencies kept
    torch.testing.assert_close(llama3[-4:], default[-4:] / 8.0)  # low frequencies divided
    yarn = {**base, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    scaled = inverse_frequencies(64, yarn)
    assert torch.equal(scaled[:4], default[:4])  # yarn: high frequencies extrapolated as they are
    torch.testing.assert_close(scaled[-4:], default[-4:] / 4.0)  # low ones interpolated
    with pytest.raises(ModelLoadError, match="longrope"):
        inverse_frequencies(64, {**base, "rope_type": "longrope"})


_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not available")
@pytest.mark.parametrize("size", [1, 2])
def test_packed_weights_match_plain(size: int) -> None:
    """oneDNN-packed layers compute what the plain ones do (any row count, bias, TP shards)."""
    w1, b1, w2, b2 = torch.randn(48, 24), torch.randn(48), torch.randn(24, 48), torch.randn(24)
    vocab = torch.randn(37, 24)
    for rows in (0, 1, 5, 130):
        x = torch.randn(rows, 24)
        total, logits = torch.zeros(rows, 24), []
        for rank in range(size):
            tp = LocalTP(rank, size)
            col, row = ColumnParallelLinear(24, 48, True, tp), RowParallelLinear(48, 24, True, tp)
            head, emb = ParallelLMHead(37, 24, tp), VocabParallelEmbedding(37, 24, tp)
            for layer, name, full in ((col, "weight", w1), (col, "bias", b1), (row, "weight", w2)):
                _load(layer, name, full)
            _load(row, "bias", b2)
            _load(emb, "weight", vocab)
            head.tie(emb)
            plain = (row(col(x)), head(x))
            assert col.pack_weight() and row.pack_weight() and head.pack_weight()
            assert col.weight is None and row.weight is None and head.weight is emb.weight  # tied: kept
            torch.testing.assert_close(row(col(x)), plain[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(head(x), plain[1], atol=1e-4, rtol=1e-4)
            total += row(col(x)) - (b2 if rank else 0)  # LocalTP: each rank adds the bias
            logits.append(head(x))
        torch.testing.assert_close(total, F.linear(F.linear(x, w1, b1), w2, b2), atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(torch.cat(logits, -1)[:, :37], x @ vocab.T, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not available")
def test_bfloat16_weights_pack_where_the_cpu_computes_bf16_and_give_the_same_bits() -> None:
    """Where oneDNN computes bf16 natively a bf16 weight is packed, and the packed GEMM
    gives exactly the plain one's bits at every row count (outputs unchanged); elsewhere
    it stays plain."""
    weight, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    col = ColumnParallelLinear(64, 96, True, LocalTP(0, 1), dtype=torch.bfloat16)
    _load(col, "weight", weight)
    _load(col, "bias", bias)
    inputs = [torch.randn(rows, 64).bfloat16() for rows in (0, 1, 7, 64, 300)]
    plain = [col(x) for x in inputs]
    packed = col.pack_weight()
    assert packed == native_half_precision(torch.bfloat16)
    if packed:
        assert col.weight is None and isinstance(col.packed, PackedWeight)
    for x, expected in zip(inputs, plain, strict=True):
        assert torch.equal(col(x), expected)
