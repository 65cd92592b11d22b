"""Llama-3 RoPE scaling (`rope_type: "llama3"`, used by Llama-3.1+ and Llama-4).

Frequencies whose wavelength is shorter than original_max / high_freq_factor are kept, those
longer than original_max / low_freq_factor are divided by `factor`, and the band in between is
interpolated smoothly. cos/sin are not rescaled (attention factor 1). The arithmetic follows
transformers' `_compute_llama3_parameters` in fp32, so the tables agree bit for bit.
"""
from __future__ import annotations

import math

import torch

from models.config import RopeConfig
from models.layers.rotary import RotaryEmbedding


class Llama3RotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig,
                 rotary_dim: int | None = None, is_neox_style: bool = True) -> None:
        missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in rope.params]
        if missing:
            raise ValueError(f"rope_scaling of type 'llama3' lacks {', '.join(missing)}")
        # transformers falls back to max_position_embeddings when the pre-training length is absent.
        self._original_max = rope.original_max_position_embeddings or max_position
        super().__init__(head_dim, max_position, rope, rotary_dim, is_neox_style)

    def inv_frequencies(self) -> torch.Tensor:
        inv_freq = super().inv_frequencies()
        factor = self.rope.factor
        low, high = self.rope.params["low_freq_factor"], self.rope.params["high_freq_factor"]
        old_len = self._original_max
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
