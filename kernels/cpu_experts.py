"""The expert layer on the CPU: the fast path behind ``fused_experts(..., backend="torch")`` for
CPU tensors. ``kernels.reference.fused_experts_torch`` stays the oracle it is tested against.

Legend: T tokens, D hidden, E experts (local), F expert intermediate size, K top-k,
R = T*K routed rows, P padded rows per expert.

Two shapes of the same computation, chosen by the number of routed rows (measured on a 2-core
AVX-512 VM at D=256, F=128, E=16, top-4, fp32):
- few rows (decode steps): every expert's rows padded to the largest group and run as two
  batched matmuls, so the op count does not grow with E (the Python loop over experts costs more
  than the padding at these sizes);
- many rows (prefill): tokens sorted by expert once, then per expert that got rows: gather,
  gate_up GEMM, SiLU(gate)*up, routed weight folded into the activation (the down projection is
  linear, so w * (h @ W2) == (w * h) @ W2 up to fp32 rounding), down GEMM, and one index_add
  into the output. No [R, D] intermediate is materialised, which at R=32768 cost more than the
  GEMMs' overhead (its zero-fill and page faults). torch's CPU ``_grouped_mm`` measured slower
  than both at these shapes, so it is not used.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Up to this many routed rows the padded batched form runs (small decode batches), above the
# sorted loop: at 64 decode tokens of the workload the routing is uneven (largest group ~2x the
# mean), and the loop measured 1.9 ms against 2.4 ms for the padded form.
PADDED_MAX_ROWS = 128


def _route(topk_ids_TK: torch.Tensor, expert_map_E: torch.Tensor | None) -> torch.Tensor:
    """Local expert of each routed row, -1 for experts not on this rank: [R] int64."""
    ids_R = topk_ids_TK.reshape(-1).long()
    if expert_map_E is not None:
        ids_R = expert_map_E.long()[ids_R]
    return ids_R


def _padded(x_TD, w13_EFD, w2_EDF, weights_R, ids_R, K):
    """Every expert's rows padded to P = the largest group: two bmm's over [E, P, *]."""
    T, D = x_TD.shape
    E, F2, _ = w13_EFD.shape
    valid_R = ids_R >= 0
    counts_E = torch.bincount(ids_R[valid_R], minlength=E)
    P = int(counts_E.max()) if valid_R.any() else 0
    out_TD = torch.zeros(T, D, dtype=x_TD.dtype)
    if P == 0:
        return out_TD
    order_R = torch.argsort(ids_R, stable=True)  # rows of experts elsewhere (-1) sort first
    skipped = int((~valid_R).sum())
    order_V = order_R[skipped:]
    ids_V = ids_R[order_V]
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    slot_V = ids_V * P + torch.arange(order_V.numel()) - starts_E[ids_V]  # row in [E * P]
    x_PD = x_TD.new_zeros(E * P, D)
    x_PD.index_copy_(0, slot_V, x_TD.index_select(0, order_V // K))
    gate_up_EP2 = torch.bmm(x_PD.view(E, P, D), w13_EFD.transpose(1, 2))
    h_EPF = F.silu(gate_up_EP2[..., :F2 // 2]).mul_(gate_up_EP2[..., F2 // 2:])
    y_PD = torch.bmm(h_EPF, w2_EDF.transpose(1, 2)).view(E * P, D)
    y_VD = y_PD.index_select(0, slot_V).mul_(weights_R[order_V, None].to(y_PD.dtype))
    out_TD.index_add_(0, order_V // K, y_VD)
    return out_TD


def _sorted_loop(x_TD, w13_EFD, w2_EDF, weights_R, ids_R, K):
    """Rows sorted by expert once; per expert with rows: two GEMMs and one index_add."""
    T, D = x_TD.shape
    E, F2, _ = w13_EFD.shape
    order_R = torch.argsort(ids_R, stable=True)
    counts = torch.bincount(ids_R + 1, minlength=E + 1).tolist()  # counts[0]: experts elsewhere
    token_R = order_R // K
    weights_sorted_R = weights_R[order_R]
    out_TD = torch.zeros(T, D, dtype=x_TD.dtype)
    start = counts[0]
    for e, n in enumerate(counts[1:]):
        if n == 0:
            continue
        tokens_n = token_R[start:start + n]
        gate_up_n2 = torch.mm(x_TD.index_select(0, tokens_n), w13_EFD[e].t())
        h_nF = F.silu(gate_up_n2[:, :F2 // 2]).mul_(gate_up_n2[:, F2 // 2:])
        h_nF.mul_(weights_sorted_R[start:start + n, None].to(h_nF.dtype))
        out_TD.index_add_(0, tokens_n, torch.mm(h_nF, w2_EDF[e].t()))
        start += n
    return out_TD


def fused_experts_cpu(
    x_TD: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    expert_map_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as kernels.reference.fused_experts_torch (shapes checked by the seam).

    fp32 activations accumulate in fp32 as the reference does; fp16/bf16 ones (rare on the CPU)
    go through the reference, which computes the routed sum in fp32.
    """
    if x_TD.is_cuda or x_TD.dtype != torch.float32:
        from kernels.reference import fused_experts_torch
        return fused_experts_torch(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, expert_map_E)
    K = topk_ids_TK.shape[1]
    ids_R = _route(topk_ids_TK, expert_map_E)
    weights_R = topk_weights_TK.reshape(-1)
    if ids_R.numel() <= PADDED_MAX_ROWS:
        return _padded(x_TD, w13_EFD, w2_EDF, weights_R, ids_R, K)
    return _sorted_loop(x_TD, w13_EFD, w2_EDF, weights_R, ids_R, K)
