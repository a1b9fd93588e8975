"""A GGUF checkpoint's quantized blocks, kept as stored, for --quantization gguf.

Each Q4_0, Q4_1 or Q8_0 tensor's blocks are gathered under the parameter it loads into
(the model's own checkpoint mapping): fused parameters (qkv, gate_up) get their shards'
block rows stacked in the order the float weights are, so the blocks dequantize to exactly
the loaded float32 weight (tests/test_gguf_quant.py checks every one). A fused parameter
whose shards differ in block type, and tensors of other types, keep float32.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
import torch

from kvferry.errors import ConfigError
from kvferry.model.causal_lm import CausalLM, Target
from kvferry.model.layers.gguf_kernel import BLOCK, BlockType, GGUFBlocks
from kvferry.model.loader.gguf_reader import GGUFFile, TensorInfo
from kvferry.model.loader.gguf_weights import hf_name, unpermute_rope

logger = logging.getLogger(__name__)

SHARD_ORDER: tuple[object, ...] = (None, "q", "k", "v", 0, 1)  # fused parameters' row order (one rank)


def kept_gguf_blocks(path: str, model: CausalLM, tp_size: int) -> dict[str, GGUFBlocks]:
    """Parameter name -> its blocks, for every parameter whose checkpoint tensors are all
    of one block type the kernel multiplies."""
    if tp_size != 1:
        raise ConfigError("--quantization gguf runs on one rank (--tensor-parallel-size 1)")
    reader = GGUFFile(path)
    shards: dict[str, dict[object, tuple[BlockType, torch.Tensor]]] = defaultdict(dict)
    others: set[str] = set()
    for info in reader.tensors:
        target = model.checkpoint_target(hf_name(info.name))
        if not isinstance(target, Target):
            continue
        if info.qtype not in BlockType._value2member_map_ or len(info.shape) != 2:
            others.add(target.param)
            continue
        block_type = BlockType(info.qtype)
        shards[target.param][target.shard_id] = (block_type, _rows(reader, info))
    kept = {}
    for param, parts in shards.items():
        types = {block_type for block_type, _ in parts.values()}
        if param in others or len(types) != 1:
            continue
        rows = [parts[shard][1] for shard in SHARD_ORDER if shard in parts]
        data = torch.cat(rows) if len(rows) > 1 else rows[0]
        in_features = data.shape[1] // next(iter(types)).block_bytes * BLOCK
        kept[param] = GGUFBlocks(next(iter(parts.values()))[0], data, in_features)
    logger.info("kept %d GGUF weights as their blocks (%d MiB)", len(kept), _mib(kept))
    return kept


def _rows(reader: GGUFFile, info: TensorInfo) -> torch.Tensor:
    """The tensor's blocks as uint8 [rows, bytes per row], rows in transformers' order."""
    data = torch.from_numpy(np.array(reader.raw(info), dtype=np.uint8, copy=True)).reshape(info.shape[0], -1)
    meta = reader.fields
    arch = meta.get("general.architecture")
    if arch == "llama" and info.name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = int(meta.get(f"{arch}.attention.head_count", 0))
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        data = unpermute_rope(data, heads if info.name.endswith("attn_q.weight") else kv_heads)
    return data.contiguous()


def _mib(kept: dict[str, GGUFBlocks]) -> int:
    return sum(b.data.numel() for b in kept.values()) >> 20
