"""kvferry bench moe-split: tensor- against expert-parallel experts on tensor-parallel ranks,
a stack of MoE layers (router + routed experts, random weights) timed per forward.

Each rank is a process (gloo, one torch thread); every rank routes the same tokens (same
seed) and all-reduces its partial sums, as the engine does. Shapes: ``tiny`` is the test
checkpoints' (tests/fixtures/tiny_moe.py: hidden 64, 8 experts of 32, top-2);
``qwen3-30b-a3b`` is Qwen3-30B-A3B's (hidden 2048, 128 experts of 768, top-8), over
``--layers`` layers. Token counts: decode steps at batch 1 and 32, a 512-token prefill.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass

from kvferry_bench.results import host_facts, save_json

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int


SHAPES = {
    "tiny": MoEShape(hidden=64, intermediate=32, num_experts=8, top_k=2),
    "qwen3-30b-a3b": MoEShape(hidden=2048, intermediate=768, num_experts=128, top_k=8),
}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512], help="tokens per forward")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", default="bench-results/moe_split.json")


def build_stack(shape: MoEShape, layers: int, tp, seed: int = 0):  # noqa: ANN001 - TPGroup
    import torch

    from kvferry.model.moe import FusedExperts, Router, RouterKind, SparseMoE

    gen = torch.Generator().manual_seed(seed)
    stack = []
    for _ in range(layers):
        gate = Router(
            RouterKind.SOFTMAX_TOPK, shape.num_experts, shape.hidden, shape.top_k, norm_topk_prob=True
        )
        gate.weight.data.copy_(torch.randn(gate.weight.shape, generator=gen))  # the same on every rank
        experts = FusedExperts(shape.num_experts, shape.hidden, shape.intermediate, tp, torch.float32)
        for param in (experts.w13, experts.w2):
            param.data.normal_(0.0, 0.02)
        stack.append(SparseMoE(gate, experts))
    return stack


def time_stack(stack, tokens: int, hidden: int, repeats: int) -> dict:  # noqa: ANN001
    """Median and best milliseconds of one forward through the stack (ranks in step; on a
    loaded host the best is the steadier comparison)."""
    import torch
    import torch.distributed as dist

    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    samples = []
    with torch.inference_mode():
        for i in range(repeats + 2):
            dist.barrier()
            start = time.perf_counter()
            h = x
            for layer in stack:
                h = layer(h)
            if i >= 2:  # two warm-ups
                samples.append((time.perf_counter() - start) * 1e3)
    return {"ms_median": statistics.median(samples), "ms_min": min(samples)}


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    from kvferry.config import MoEParallel
    from kvferry.model.layers.parallel import TPGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for shape_name in args.shapes:
            shape = SHAPES[shape_name]
            for mode in MoEParallel:
                tp = TPGroup(rank, world, dist.group.WORLD, moe=mode)
                stack = build_stack(shape, args.layers, tp)
                for tokens in args.tokens:
                    times = time_stack(stack, tokens, shape.hidden, args.repeats)
                    if rank == 0:
                        results.append(
                            {"shape": shape_name, "moe_parallel": mode.value, "tokens": tokens, **times}
                        )
                del stack
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    from kvferry.ports import free_port

    world = args.tensor_parallel_size
    with mp.Manager() as manager:
        rows = manager.list()
        mp.spawn(rank_main, args=(world, free_port(), args, rows), nprocs=world, join=True)
        rows = list(rows)
    result = {
        "bench": "moe-split",
        "tensor_parallel_size": world,
        "layers": args.layers,
        "repeats": args.repeats,
        "shapes": {name: asdict(SHAPES[name]) for name in args.shapes},
        **host_facts(),
        "threads_per_rank": 1,
        "rows": rows,
    }
    for row in rows:
        logger.info(
            "%(shape)s %(moe_parallel)s %(tokens)d tokens: %(ms_median).2f ms (best %(ms_min).2f)", row
        )
    save_json(result, args.output)
    print(json.dumps(result, indent=2))
    return result
