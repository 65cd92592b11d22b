"""Rotary position embeddings: NeoX (rotate halves) and interleaved (rotate pairs) layouts.

cos/sin are computed in fp32 for all positions up to `max_position` once, then indexed.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from kernels.cpu_native import ops as native_ops
from kernels.triton_fused import fused_kernels_serve
from models.config import RopeConfig

# Scaling type -> (module, class) of its RotaryEmbedding subclass, imported on use.
_SCALED_ROPE = {
    "yarn": ("models.layers.rotary_yarn", "YarnRotaryEmbedding"),
    "llama3": ("models.layers.rotary_llama3", "Llama3RotaryEmbedding"),
}


def use_triton_fused(x: torch.Tensor) -> bool:
    """Whether RoPE (and the fused q/k norm + RoPE) runs the Triton kernels (CUDA, Triton
    importable). Tests monkeypatch this to run them on the CPU under TRITON_INTERPRET=1."""
    return fused_kernels_serve(x)


# Weak values: a table lives as long as some model's layers hold it.
_ROPE_CACHE: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def get_rope(head_dim: int, max_position: int, rope: RopeConfig, rotary_dim: int | None = None,
             is_neox_style: bool = True) -> "RotaryEmbedding":
    """The rotary embedding for a config's RoPE scaling type.

    Layers asking for the same RoPE share one module, so a model holds one cos/sin table, not
    one per layer (at 40k positions that is ~20 MB a layer).
    """
    key = (head_dim, max_position, repr(rope), rotary_dim, is_neox_style,
           torch.get_default_dtype(), str(torch.empty(0).device))
    cached = _ROPE_CACHE.get(key)
    if cached is not None:
        return cached
    if rope.scaling_type == "default":
        cls = RotaryEmbedding
    elif rope.scaling_type in _SCALED_ROPE:
        import importlib

        module, name = _SCALED_ROPE[rope.scaling_type]
        cls = getattr(importlib.import_module(module), name)
    else:
        raise ValueError(f"rope scaling type {rope.scaling_type!r} is not supported; "
                         f"supported: default, {', '.join(_SCALED_ROPE)}")
    _ROPE_CACHE[key] = module_ = cls(head_dim, max_position, rope, rotary_dim, is_neox_style)
    return module_


class RotaryEmbedding(nn.Module):
    """Unscaled RoPE. Scaled variants override `inv_frequencies` and/or `cos_sin`."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig,
                 rotary_dim: int | None = None, is_neox_style: bool = True) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.is_neox_style = is_neox_style
        self.rope = rope
        cos, sin = self.cos_sin(max_position)
        # Not parameters and not in the checkpoint; moved with the module.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def inv_frequencies(self) -> torch.Tensor:
        d = self.rotary_dim
        return 1.0 / (self.rope.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def cos_sin(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 [max_position, rotary_dim / 2] tables."""
        inv_freq = self.inv_frequencies()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device=inv_freq.device), inv_freq)
        return freqs.cos(), freqs.sin()

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
        q [T, Hq, head_dim]; k [T, Hk, head_dim] -> rotated (q, k). On CUDA one Triton launch
        for both (subclasses change only the tables, which the kernel reads)."""
        if use_triton_fused(q):
            from kernels.triton_fused.rope import rope_triton

            return rope_triton(positions, q, k, self.cos_cache, self.sin_cache, self.rotary_dim, self.is_neox_style)
        if not q.is_cuda:  # fp32 on the CPU: one native pass (kernels/cpu_native/norm_rope.c)
            native = native_ops.rope(positions, q, k, self.cos_cache, self.sin_cache, self.rotary_dim,
                                     self.is_neox_style)
            if native is not None:
                return native
        cos = self.cos_cache[positions][:, None, :]
        sin = self.sin_cache[positions][:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def fuses_qk_norm(self, q: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module) -> bool:
        """Whether forward_with_qk_norm runs the one Triton launch (which can also write the KV cache)."""
        return use_triton_fused(q) and q_norm.eps == k_norm.eps

    def forward_with_qk_norm(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             q_norm: nn.Module, k_norm: nn.Module, kv_write: dict | None = None):
        """forward(positions, q_norm(q), k_norm(k)) for per-head RMSNorms (Qwen3): on CUDA one
        Triton launch that normalises and rotates q and k. kv_write (only where fuses_qk_norm):
        qk_norm_rope_triton's v_TGd / kv_cache_2NSGd / slot_mapping_T, so the same launch also
        writes the layer's KV cache."""
        if self.fuses_qk_norm(q, q_norm, k_norm):
            from kernels.triton_fused.rope import qk_norm_rope_triton

            return qk_norm_rope_triton(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, self.cos_cache,
                                       self.sin_cache, self.rotary_dim, self.is_neox_style, **(kv_write or {}))
        if kv_write:
            raise ValueError("kv_write needs the fused Triton launch (fuses_qk_norm)")
        if not q.is_cuda and q_norm.eps == k_norm.eps:  # fp32 on the CPU: norms and rotation in one native pass
            native = native_ops.rope(positions, q, k, self.cos_cache, self.sin_cache, self.rotary_dim,
                                     self.is_neox_style, q_norm.weight, k_norm.weight, q_norm.eps)
            if native is not None:
                return native
        return self(positions, q_norm(q), k_norm(k))
