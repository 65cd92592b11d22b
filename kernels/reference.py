"""Pure-torch reference of the expert layer (the CPU path, and the oracle for every kernel).

Legend: T tokens, D hidden, E experts (local), F expert intermediate size, K top-k.

Activations of the gated expert MLP (`activation`, gate = first F columns of gate_up, up = last F):
- "silu": SiLU(gate) * up;
- "swigluoai" (gpt-oss; vLLM's name): gate = min(gate, limit), up = clamp(up, -limit, limit),
  gate * sigmoid(alpha * gate) * (up + 1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import batch_invariant

ACTIVATIONS = ("silu", "swigluoai")


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def gated_activation(gate_up: torch.Tensor, activation: str = "silu", alpha: float = 1.702,
                     limit: float = 7.0) -> torch.Tensor:
    """[..., 2F] gate then up -> [..., F], in gate_up's dtype (see the module docstring)."""
    f = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :f], gate_up[..., f:]
    if activation == "silu":
        return batch_invariant.pointwise(F.silu, gate) * up
    check_activation(activation)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * batch_invariant.pointwise(torch.sigmoid, gate * alpha) * (up + 1)


def fused_experts_torch(
    x_TD: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    expert_map_E: torch.Tensor | None = None,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """gate_up GEMM (+ b13) -> activation -> down GEMM (+ b2) -> routed weight -> sum over top-k.

    Rows are sorted by expert once, then each expert with tokens runs two dense GEMMs on its
    contiguous slice; the routed weight is applied in fp32 before the sum, as the kernels do.
    Without biases and with "silu" the activation runs in the activation dtype (as it always
    has); otherwise the GEMM outputs go to fp32, the biases ([E, 2F], [E, D]) are added there
    and the activation runs there, h being rounded to the activation dtype for the down GEMM
    (what the Triton kernel stores). Rows of experts not on this rank get no bias either.
    """
    check_activation(activation)
    plain = w13_bias is None and activation == "silu"
    T, D = x_TD.shape
    K = topk_ids_TK.shape[1]
    ids_TK = topk_ids_TK.long()
    if expert_map_E is not None:
        ids_TK = expert_map_E.long()[ids_TK]  # global -> local; -1 = not on this rank
    flat_ids = ids_TK.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    token_of_row = order // K
    counts = torch.bincount(sorted_ids.clamp(min=-1) + 1, minlength=w13_EFD.shape[0] + 1)
    # counts[0] are rows whose expert lives elsewhere: they are skipped and add nothing.
    counts_list = counts.tolist()
    out_RD = torch.zeros(T * K, D, dtype=torch.float32, device=x_TD.device)
    start = counts_list[0]
    for e, n in enumerate(counts_list[1:]):
        if n == 0:
            continue
        rows = slice(start, start + n)
        xe = x_TD[token_of_row[rows]]
        gate_up = _mm(xe, w13_EFD[e].t())
        if plain:
            h = gated_activation(gate_up)
        else:
            gate_up = gate_up.float()
            if w13_bias is not None:
                gate_up = gate_up + w13_bias[e].float()
            h = gated_activation(gate_up, activation, swiglu_alpha, swiglu_limit).to(x_TD.dtype)
        out_RD[rows] = _mm(h, w2_EDF[e].t()).float()
        if w2_bias is not None:
            out_RD[rows] += w2_bias[e].float()  # before the routed weight, as in gpt-oss
        start += n
    weights_R = topk_weights_TK.reshape(-1)[order].float()
    out_RD *= weights_R[:, None]
    if batch_invariant.enabled():  # each token's K outputs summed in slot order, no atomics
        out_TKD = torch.empty_like(out_RD)
        out_TKD[order] = out_RD
        out_TKD = out_TKD.view(T, K, D)
        out_TD = out_TKD[:, 0].clone()
        for k in range(1, K):
            out_TD += out_TKD[:, k]
        return out_TD.to(x_TD.dtype)
    out_TD = torch.zeros(T, D, dtype=torch.float32, device=x_TD.device)
    out_TD.index_add_(0, token_of_row, out_RD)
    return out_TD.to(x_TD.dtype)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b; in batch-invariant mode on fixed row tiles (kernels/batch_invariant.py)."""
    return batch_invariant.matmul(a, b) if batch_invariant.enabled() else a @ b
