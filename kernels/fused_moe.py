"""The expert-layer seam: one call that every MoE block goes through, whatever the backend.

Legend: T tokens, D hidden, E experts held here, F expert intermediate size, K top-k.
"""
from __future__ import annotations

import torch

from kernels.reference import fused_experts_torch

_BACKENDS = ("torch", "triton")


def _triton_usable(x: torch.Tensor) -> bool:
    if not x.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on `device`, best first."""
    probe = torch.empty(0, device=device)
    return (["triton"] if _triton_usable(probe) else []) + ["torch"]


def _check_shapes(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, expert_map_E):
    if x_TD.dim() != 2:
        raise ValueError(f"hidden_states must be [T, D], got shape {tuple(x_TD.shape)}")
    T, D = x_TD.shape
    if w13_EFD.dim() != 3 or w13_EFD.shape[2] != D or w13_EFD.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2F, {D}], got shape {tuple(w13_EFD.shape)}")
    E, F2, _ = w13_EFD.shape
    if tuple(w2_EDF.shape) != (E, D, F2 // 2):
        raise ValueError(f"w2 must be [{E}, {D}, {F2 // 2}], got shape {tuple(w2_EDF.shape)}")
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != T:
        raise ValueError(f"topk_ids must be [{T}, K], got shape {tuple(topk_ids_TK.shape)}")
    if topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(
            f"topk_weights {tuple(topk_weights_TK.shape)} and topk_ids "
            f"{tuple(topk_ids_TK.shape)} must have the same shape")
    if expert_map_E is not None and expert_map_E.dim() != 1:
        raise ValueError(f"expert_map must be 1-D [num_global_experts], got {tuple(expert_map_E.shape)}")


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Run the routed experts of one MoE layer and sum their weighted outputs.

    Args:
        hidden_states: [T, D] activations (fp32, fp16 or bf16).
        w13: [E, 2F, D], per expert the gate rows then the up rows.
        w2: [E, D, F] down projection.
        topk_weights: [T, K] routed weights (applied in fp32 to each expert's output).
        topk_ids: [T, K] expert ids: global ids when `expert_map` is given, else local ids in [0, E).
        expert_map: optional [E_global] int tensor mapping global ids to local ids, -1 meaning the
            expert is not on this rank (that slot contributes zero).
        backend: "torch", "triton", or None for the best one available on the tensors' device.
    Returns:
        [T, D] in the dtype of `hidden_states`.
    """
    _check_shapes(hidden_states, w13, w2, topk_weights, topk_ids, expert_map)
    if backend is None:
        backend = "triton" if _triton_usable(hidden_states) else "torch"
    if backend == "torch":
        return fused_experts_torch(hidden_states, w13, w2, topk_weights, topk_ids, expert_map)
    if backend == "triton":
        from kernels.triton_moe import fused_experts_triton
        return fused_experts_triton(hidden_states, w13, w2, topk_weights, topk_ids, expert_map)
    raise ValueError(f"unknown fused_experts backend {backend!r}; choose one of {_BACKENDS} or None")
