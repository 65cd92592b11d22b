"""Rotary position embeddings: NeoX (rotate halves) and interleaved (rotate pairs) layouts.

cos/sin are computed in fp32 for all positions up to `max_position` once, then indexed.
"""
from __future__ import annotations

import torch
from torch import nn

from models.config import RopeConfig

SUPPORTED_ROPE_TYPES = ("default",)


def inv_frequencies(rotary_dim: int, rope: RopeConfig) -> torch.Tensor:
    if rope.scaling_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope.scaling_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig,
                 rotary_dim: int | None = None, is_neox_style: bool = True) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.is_neox_style = is_neox_style
        inv_freq = inv_frequencies(self.rotary_dim, rope)
        t = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq)
        # Not a parameter and not in the checkpoint; moved with the module.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        dtype = x.dtype
        rot = rot.float()
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        out = torch.cat((o1, o2), dim=-1) if self.is_neox_style else torch.stack((o1, o2), dim=-1).flatten(-2)
        out = out.to(dtype)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T] (< max_position, checked against max_model_len at start-up);
        q [T, Hq, head_dim]; k [T, Hk, head_dim] -> rotated (q, k)."""
        cos = self.cos_cache[positions][:, None, :]
        sin = self.sin_cache[positions][:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
