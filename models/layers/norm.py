"""RMSNorm, computed in fp32 as Hugging Face does, with an optional fused residual add."""
from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_native import ops as native_ops
from kernels.triton_fused import fused_kernels_serve
from kernels.triton_fused.moe_sum import TopKSum
from models.layers.weights import ReplicatedLoader, attach_loader, new_param


def use_triton_fused(x: torch.Tensor) -> bool:
    """Whether RMSNorm runs the fused Triton kernel (CUDA, Triton importable). Tests monkeypatch
    this to run it on the CPU under TRITON_INTERPRET=1."""
    return fused_kernels_serve(x)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = attach_loader(new_param(hidden_size), ReplicatedLoader((hidden_size,)))

    def forward(self, x: torch.Tensor | TopKSum, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual).
        On CUDA, for x [T, D] or [T, H, D]: one Triton launch with the same rounding; on the CPU in
        fp32, for x [T, D]: one native pass. x may be an MoE layer's TopKSum: with the residual on
        the Triton path, its sum is part of the same launch."""
        if isinstance(x, TopKSum):
            if residual is not None and use_triton_fused(x.y_TKD):
                from kernels.triton_fused.rms_norm import rms_norm_topk_sum_triton

                return rms_norm_topk_sum_triton(x.y_TKD, self.weight, self.eps, residual)
            x = x.materialize()
        if x.dim() in (2, 3) and use_triton_fused(x):
            from kernels.triton_fused.rms_norm import rms_norm_triton

            return rms_norm_triton(x, self.weight, self.eps, residual)
        if not x.is_cuda:  # fp32 on the CPU: one native pass (kernels/cpu_native/norm_rope.c)
            native = native_ops.rms_norm(x, self.weight, self.eps, residual)
            if native is not None:
                return native
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
