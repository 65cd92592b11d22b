"""Compute kernels: Triton kernels, their launchers, and a pure-torch reference for each.

The expert layer is reached through one seam, :func:`fused_experts`.
"""
from kernels.fused_moe import fused_experts, available_backends

__all__ = ["fused_experts", "available_backends"]
