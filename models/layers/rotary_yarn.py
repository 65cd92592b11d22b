"""YaRN RoPE scaling (https://arxiv.org/abs/2309.00071), as Hugging Face computes it.

Frequencies blend position interpolation (divided by `factor`) and extrapolation along a linear
ramp between the dimensions set by `beta_fast` / `beta_slow`; cos/sin are multiplied by the
attention factor (DeepSeek: mscale(factor, mscale) / mscale(factor, mscale_all_dim)). The
softmax-scale correction (mscale(factor, mscale_all_dim)^2 in DeepSeek-V3) is the attention
layer's business: see `yarn_softmax_scale`.
"""
from __future__ import annotations

import math

import torch

from models.config import RopeConfig
from models.layers.rotary import RotaryEmbedding


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(head_dim: int, rope: RopeConfig) -> float:
    """head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for a scaled RoPE that sets
    `mscale_all_dim` (DeepSeek-V2/V3)."""
    scale = head_dim ** -0.5
    mscale_all_dim = rope.params.get("mscale_all_dim", 0.0)
    if rope.scaling_type != "default" and mscale_all_dim:
        m = yarn_get_mscale(rope.factor, mscale_all_dim)
        scale = scale * m * m
    return scale


class YarnRotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig,
                 rotary_dim: int | None = None, is_neox_style: bool = True) -> None:
        self.original_max_position = rope.original_max_position_embeddings or max_position
        super().__init__(head_dim, max_position, rope, rotary_dim, is_neox_style)

    def attention_factor(self) -> float:
        p, factor = self.rope.params, self.rope.factor
        if p.get("attention_factor") is not None:
            return float(p["attention_factor"])
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        return yarn_get_mscale(factor)

    def inv_frequencies(self) -> torch.Tensor:
        d, base, factor, p = self.rotary_dim, self.rope.theta, self.rope.factor, self.rope.params
        beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1
        truncate = bool(p.get("truncate", True))

        def correction_dim(num_rotations: float) -> float:
            return (d * math.log(self.original_max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # no singular ramp
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_weight = 1 - ramp
        pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
        inv_extrapolation = 1.0 / pos_freqs
        inv_interpolation = 1.0 / (factor * pos_freqs)
        return inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight

    def cos_sin(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().cos_sin(max_position)
        a = self.attention_factor()
        return cos * a, sin * a
