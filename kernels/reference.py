"""Pure-torch reference of the expert layer (the CPU path, and the oracle for every kernel).

Legend: T tokens, D hidden, E experts (local), F expert intermediate size, K top-k.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_experts_torch(
    x_TD: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    expert_map_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """gate_up GEMM -> SiLU(gate)*up -> down GEMM -> routed weight -> sum over top-k.

    Rows are sorted by expert once, then each expert with tokens runs two dense GEMMs on its
    contiguous slice; the routed weight is applied in fp32 before the sum, as the kernels do.
    """
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
        gate_up = xe @ w13_EFD[e].t()
        f = gate_up.shape[1] // 2
        h = F.silu(gate_up[:, :f]) * gate_up[:, f:]
        out_RD[rows] = (h @ w2_EDF[e].t()).float()
        start += n
    weights_R = topk_weights_TK.reshape(-1)[order].float()
    out_RD *= weights_R[:, None]
    out_TD = torch.zeros(T, D, dtype=torch.float32, device=x_TD.device)
    out_TD.index_add_(0, token_of_row, out_RD)
    return out_TD.to(x_TD.dtype)
