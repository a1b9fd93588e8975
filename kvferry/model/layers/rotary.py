"""Rotary position embedding (rotate-half / NeoX style) with a precomputed cos/sin cache.

Supported `rope_type`s: default, linear, llama3, proportional (Gemma 4), yarn (DeepSeek;
its attention factor scales cos and sin, as transformers scales them).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from kvferry.errors import ModelLoadError

logger = logging.getLogger(__name__)

ROPE_TYPES = ("default", "linear", "llama3", "proportional", "yarn")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's rope parameters (transformers 5 `rope_parameters`, or legacy fields).

    Models whose layer types differ in rope (Gemma 3: `sliding_attention` layers use the
    local base frequency) key `rope_parameters` by layer type: pass the layer's type.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params and _is_per_layer_type(params):
        if layer_type not in params:
            raise ModelLoadError(f"rope_parameters has no entry for layer type {layer_type!r}")
        params = dict(params[layer_type])
    elif params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _is_per_layer_type(params: dict[str, Any]) -> bool:
    return any(isinstance(value, dict) for value in params.values())


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: keep high frequencies, divide low ones by `factor`, blend between."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    is_mid = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(is_mid, blended, scaled)


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    if kind == "proportional":
        return _proportional_inv_freq(head_dim, base, params)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, base, params)
    raise ModelLoadError(f"rope scaling type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")


def _proportional_inv_freq(head_dim: int, base: float, params: dict[str, Any]) -> torch.Tensor:
    """Gemma 4's global layers: the first `partial_rotary_factor` of the frequency pairs
    rotate with exponents over the whole head_dim; the remaining pairs do not rotate
    (frequency 0: cos 1, sin 0); all divided by `factor`."""
    rotated = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    exponents = torch.arange(0, 2 * rotated, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = torch.zeros(head_dim // 2, dtype=torch.float32)
    inv_freq[:rotated] = 1.0 / (base**exponents)
    return inv_freq / float(params.get("factor", 1.0))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(params: dict[str, Any]) -> float:
    """What yarn multiplies cos and sin by (1 for other rope types), as transformers
    infers it when the config states none."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def yarn_softmax_scale(params: dict[str, Any], scale: float) -> float:
    """DeepSeek's attention scale under a scaled rope: times mscale(factor, mscale_all_dim)^2."""
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] == "default" or not mscale_all_dim:
        return scale
    mscale = _yarn_mscale(float(params["factor"]), float(mscale_all_dim))
    return scale * mscale * mscale


def _yarn_inv_freq(head_dim: int, base: float, params: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolated (divided by `factor`) low frequencies, extrapolated high ones, a
    linear ramp between the correction dims of `beta_fast` and `beta_slow` rotations."""
    factor = float(params["factor"])
    original = float(params["original_max_position_embeddings"])
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


class RotaryEmbedding(nn.Module):
    """Applies rope to q [T, heads, head_dim] and k [T, kv_heads, head_dim] at `positions`."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        inv_freq = inverse_frequencies(head_dim, params)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim]: cos in the first half, sin in the second
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        factor = yarn_attention_factor(params)
        if factor != 1.0:
            cache = cache * factor
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, head_dim / 2], at `positions`: once per forward, for every layer."""
        cos, sin = self.cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(self.cos_sin(positions, q.dtype), q, k)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope of x [T, heads, head_dim] into a new tensor (no temporaries)."""
    x1, x2 = x.chunk(2, dim=-1)
    if torch.compiler.is_compiling():  # one fused kernel: the compiler needs no out= views
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=out2).addcmul_(x1, sin)  # x2 cos + x1 sin
    return out


def rope_per_kind(
    ropes: nn.ModuleDict, positions: torch.Tensor, dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) at `positions` of each layer type's RotaryEmbedding in `ropes`."""
    return {
        kind: rope.cos_sin(positions, dtype)
        for kind, rope in ropes.items()
        if isinstance(rope, RotaryEmbedding)
    }


def apply_rope(
    cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by `cos_sin` (RotaryEmbedding.cos_sin, computed once per forward)."""
    cos, sin = cos_sin
    return rotate(q, cos, sin), rotate(k, cos, sin)
