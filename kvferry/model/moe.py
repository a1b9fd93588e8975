"""Mixture-of-experts blocks: routers (Qwen3-MoE's softmax top-k, DeepSeek-V2's greedy and
group-limited greedy, DeepSeek-V3's sigmoid scores with a correction bias and group-limited
choice, each as transformers computes it) and the routed experts.

The experts compute grouped by expert: the (token, expert) pairs are sorted by expert, each
expert that has tokens runs two GEMMs over all of its rows, and the weighted rows are added
back to their tokens (`kvferry::moe_experts`, an operator: the loop over experts depends on
the step's routing, so a captured graph calls it as a whole). The tensor-parallel ranks
split the experts one of two ways (`--moe-parallel`, kvferry.config.MoEParallel): TENSOR
splits every expert's intermediate features (each rank a slice of every expert, as the
dense MLP's column- and row-parallel linears split theirs); EXPERT gives each rank
num_experts / tp whole experts. Either way every rank routes every token identically (the
router is replicated), computes its own share of each token's expert outputs, and the
partial sums are all-reduced.

Checkpoints store experts one by one (`mlp.experts.<e>.gate_proj.weight`, ...): they load
into the stacked `experts.w13` [experts, 2 * intermediate, hidden] (gate rows, then up) and
`experts.w2` [experts, hidden, intermediate] (`expert_target`).
"""

from __future__ import annotations

import enum
import logging
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.config import MoEParallel
from kvferry.errors import ConfigError, ModelLoadError
from kvferry.model.causal_lm import Target
from kvferry.model.layers.linear import attach_weight_loader, copy_checked
from kvferry.model.layers.parallel import TPGroup
from kvferry.model.operators import operator

logger = logging.getLogger(__name__)

_EXPERT_NAME = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
_EXPERT_PART = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}


def expert_target(name: str) -> Target | None:
    """The stacked expert parameter (and (expert, part) shard) a per-expert checkpoint
    tensor loads into; None for any other tensor."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    param, part = _EXPERT_PART[match["proj"]]
    return Target(f"{match['prefix']}.{param}", (int(match["expert"]), part))


def check_silu(config: Any) -> None:
    if config.hidden_act != "silu":
        raise ModelLoadError(f"expert activation {config.hidden_act!r} is not supported (silu)")


def local_experts(num_experts: int, tp: TPGroup) -> range:
    """The experts (global ids) this rank holds: all of them under tensor parallelism, a
    contiguous num_experts / tp under expert parallelism."""
    if tp.moe is MoEParallel.TENSOR:
        return range(num_experts)
    if num_experts % tp.size:
        raise ConfigError(
            f"--moe-parallel expert: {num_experts} experts do not split evenly over {tp.size} ranks"
        )
    count = num_experts // tp.size
    return range(tp.rank * count, (tp.rank + 1) * count)


class FusedExperts(nn.Module):
    """The routed experts' weights, stacked: this rank's experts (`experts`, global ids),
    each whole (EXPERT) or this rank's slice of its features (TENSOR)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp, self.num_experts = tp, num_experts
        self.experts = local_experts(num_experts, tp)
        split = tp.moe is MoEParallel.TENSOR
        self.local = tp.split(intermediate, "expert intermediate size") if split else intermediate
        self.feature_start = tp.rank * self.local if split else 0
        count = len(self.experts)
        self.w13 = nn.Parameter(torch.empty(count, 2 * self.local, hidden, dtype=dtype), False)
        self.w2 = nn.Parameter(torch.empty(count, hidden, self.local, dtype=dtype), False)
        for param in (self.w13, self.w2):
            attach_weight_loader(param, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert isinstance(shard_id, tuple), "expert shards are (expert, part)"
        global_expert, part = shard_id
        if global_expert >= self.num_experts:
            raise ModelLoadError(
                f"checkpoint has expert {global_expert}; the config states {self.num_experts}"
            )
        if global_expert not in self.experts:
            return  # another rank's expert
        expert = global_expert - self.experts.start
        start = self.feature_start
        if param is self.w2:
            src = loaded.narrow(1, start, self.local) if loaded.dim() == 2 else loaded
            copy_checked(param.data[expert], src, f"expert {expert} down projection")
            return
        src = loaded.narrow(0, start, self.local) if loaded.dim() == 2 else loaded
        rows = param.data[expert].narrow(0, part * self.local, self.local)
        copy_checked(rows, src, f"expert {expert} {'up' if part else 'gate'} projection")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's experts of weight * expert(x), all-reduced over the ranks."""
        out = torch.empty_like(x)
        ids = self._local_ids(topk_ids)
        grouped_experts(x, ids, topk_weights.to(x.dtype), self.w13, self.w2, out)
        return self.tp.all_reduce(out)

    def _local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids as indices into this rank's stack; another rank's experts map
        to len(self.experts), which the operator skips."""
        if len(self.experts) == self.num_experts:
            return topk_ids
        local = topk_ids - self.experts.start
        return local.masked_fill((local < 0) | (local >= len(self.experts)), len(self.experts))


@operator("moe_experts", mutates_args=("out",))
def grouped_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), grouped by expert:
    one pair of GEMMs per expert that has rows, none per token. Ids at or past the stack's
    length (w13.shape[0]: another rank's experts) are skipped."""
    out.zero_()
    if x.shape[0] == 0:
        return
    k, num_experts = topk_ids.shape[1], w13.shape[0]
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    order = order[: sum(counts)]  # this rank's pairs sort first
    tokens = order // k
    rows = x.index_select(0, tokens)
    results = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        end = start + count
        gate, up = F.linear(rows[start:end], w13[expert]).chunk(2, dim=-1)
        torch.matmul(F.silu(gate) * up, w2[expert].t(), out=results[start:end])
        start = end
    results.mul_(topk_weights.flatten().index_select(0, order).unsqueeze(1))
    out.index_add_(0, tokens, results)


@grouped_experts.register_fake
def _(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
) -> None:
    return None


class RouterKind(enum.Enum):
    """How router logits become each token's experts and weights."""

    SOFTMAX_TOPK = "softmax top-k"  # Qwen3-MoE; DeepSeek-V2 "greedy"
    SOFTMAX_GROUP_LIMITED = "softmax, group-limited top-k"  # DeepSeek-V2 "group_limited_greedy"
    SIGMOID_BIAS_GROUPED = "sigmoid, corrected, group-limited top-k"  # DeepSeek-V3


class Router(nn.Module):
    """`weight` [experts, hidden] (replicated on every rank); float32 routing as transformers'.

    Returns (expert ids [T, k], weights [T, k], float32)."""

    def __init__(
        self,
        kind: RouterKind,
        num_experts: int,
        hidden: int,
        top_k: int,
        *,
        norm_topk_prob: bool = False,
        scaling: float = 1.0,
        groups: tuple[int, int] = (1, 1),  # (n_group, topk_group)
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.kind, self.top_k, self.norm_topk_prob, self.scaling = kind, top_k, norm_topk_prob, scaling
        self.num_groups, self.topk_groups = groups
        if kind is not RouterKind.SOFTMAX_TOPK and num_experts % self.num_groups:
            raise ModelLoadError(f"{num_experts} experts do not split into {self.num_groups} groups")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if kind is RouterKind.SIGMOID_BIAS_GROUPED:
            bias = torch.zeros(num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        if self.kind is RouterKind.SIGMOID_BIAS_GROUPED:
            return self._sigmoid_grouped(logits)
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if self.kind is RouterKind.SOFTMAX_GROUP_LIMITED:
            group_best = scores.view(scores.shape[0], self.num_groups, -1).amax(dim=-1)
            scores = scores.masked_fill(~self._group_mask(group_best, scores.shape[1]), 0.0)
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * self.scaling if self.scaling != 1.0 else weights

    def _group_mask(self, group_scores: torch.Tensor, num_experts: int) -> torch.Tensor:
        """Bool [T, experts]: experts in each token's `topk_groups` best groups."""
        best = torch.topk(group_scores, self.topk_groups, dim=-1)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return mask.repeat_interleave(num_experts // self.num_groups, dim=1)

    def _sigmoid_grouped(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.e_score_correction_bias is not None
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(choice.shape[0], self.num_groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~self._group_mask(group_scores, choice.shape[1]), float("-inf"))
        ids = torch.topk(choice, self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class SparseMoE(nn.Module):
    """Router + routed experts (+ shared experts, a dense MLP every token passes through).
    Module names mirror transformers': `gate`, `experts`, `shared_experts`."""

    def __init__(self, gate: Router, experts: FusedExperts, shared_experts: nn.Module | None = None):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out: torch.Tensor = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
