"""The expert layer on the CPU: the fast path behind ``fused_experts(..., backend="torch")`` for
CPU tensors. ``kernels.reference.fused_experts_torch`` stays the oracle it is tested against.

Legend: T tokens, D hidden, E experts (local), F expert intermediate size, K top-k,
R = T*K routed rows, V rows routed to experts on this rank.

Up to GROUPED_MAX_ROWS routed rows the native kernel (kernels/cpu_native/experts.c) runs where it
builds (ahead of or level with the grouped GEMM end to end, BENCHMARKS.md §6); else, and
as its fallback, two shapes of the same computation, chosen by the number of routed rows (measured on a 2-core
AVX-512 VM at D=256, F=128, E=16, top-4, fp32):
- few rows (decode steps, small prefills): rows sorted by expert once, then torch's CPU grouped
  GEMM (torch._grouped_mm) for gate_up and for down, so the op count does not grow with E;
- many rows (prefill, where the grouped GEMM measured slower than per-expert GEMMs): tokens
  sorted by expert once, then per expert that got rows: gather, gate_up GEMM, SiLU(gate)*up,
  routed weight folded into the activation (the down projection is linear, so
  w * (h @ W2) == (w * h) @ W2 up to fp32 rounding), down GEMM, and one index_add into the output.
  No [R, D] intermediate is materialised, which at R=32768 cost more than the GEMMs' overhead
  (its zero-fill and page faults).

Expert biases (w13_bias [E, 2F], w2_bias [E, D]) and the "swigluoai" activation (gpt-oss) run in
the grouped GEMM and the sorted loop (the native kernel knows neither: such calls skip it); b2
goes in before the routed weight, so the weight is then applied after the down GEMM instead of
being folded into h. Calls without them take exactly the path they took before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_native import ops as native_ops
from kernels.reference import check_activation, gated_activation

# Up to this many routed rows torch's grouped GEMM runs (decode and small prefills), above the
# sorted loop. Measured at the workload's layer, 1 thread: 64 tokens 1.3 ms against 2.0 ms for the
# loop (and 2.5 ms for every group padded to the largest and two bmm's, the routing being
# uneven); 1024 tokens equal; 8192 tokens the loop 122 ms against 156 ms.
GROUPED_MAX_ROWS = 2048


def _route(topk_ids_TK: torch.Tensor, expert_map_E: torch.Tensor | None) -> torch.Tensor:
    """Local expert of each routed row, -1 for experts not on this rank: [R] int64."""
    ids_R = topk_ids_TK.reshape(-1).long()
    if expert_map_E is not None:
        ids_R = expert_map_E.long()[ids_R]
    return ids_R


def _grouped_mm_works() -> bool:
    """Whether this torch build has a CPU grouped GEMM (torch._grouped_mm, 2.9+ on the CPU)."""
    try:
        x, w = torch.ones(2, 8), torch.ones(2, 4, 8).transpose(1, 2)
        out = torch._grouped_mm(x, w, offs=torch.tensor([1, 2], dtype=torch.int32))
        return out.shape == (2, 4) and bool((out == 8).all())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


HAVE_GROUPED_MM = _grouped_mm_works()


def _grouped(x_TD, w13_EFD, w2_EDF, weights_R, ids_R, K, extra=None):
    """Rows sorted by expert once; both GEMMs as one grouped GEMM each over the sorted rows.
    extra: None, or (w13_bias, w2_bias in fp32, activation, alpha, limit) (see _epilogues)."""
    T, D = x_TD.shape
    E, F2, _ = w13_EFD.shape
    order_R = torch.argsort(ids_R, stable=True)  # rows of experts elsewhere (-1) sort first
    counts = torch.bincount(ids_R + 1, minlength=E + 1)  # counts[0]: experts elsewhere
    skipped = int(counts[0])
    order_V = order_R[skipped:]
    out_TD = torch.zeros(T, D, dtype=x_TD.dtype)
    if order_V.numel() == 0:
        return out_TD
    offs_E = torch.cumsum(counts[1:], 0).to(torch.int32)  # end row of each expert's group
    token_V = order_V // K
    gate_up_V2 = torch._grouped_mm(x_TD.index_select(0, token_V), w13_EFD.transpose(1, 2), offs=offs_E)
    if extra is not None:
        b13, b2, *act = extra
        experts_V = ids_R.index_select(0, order_V)
        up, down = _epilogues(None if b13 is None else b13.index_select(0, experts_V),
                              None if b2 is None else b2.index_select(0, experts_V), weights_R[order_V], *act)
        out_TD.index_add_(0, token_V, down(torch._grouped_mm(up(gate_up_V2), w2_EDF.transpose(1, 2), offs=offs_E)))
        return out_TD
    h_VF = F.silu(gate_up_V2[:, :F2 // 2]).mul_(gate_up_V2[:, F2 // 2:])
    h_VF.mul_(weights_R[order_V, None].to(h_VF.dtype))  # the routed weight, folded before the down GEMM
    out_TD.index_add_(0, token_V, torch._grouped_mm(h_VF, w2_EDF.transpose(1, 2), offs=offs_E))
    return out_TD


def _epilogues(b13, b2, weights_n, activation, alpha, limit):
    """(up, down) for n sorted rows, fp32: b13 [n, 2F] or [2F], b2 [n, D] or [D] (each None
    when absent) the biases of the rows' experts, weights_n [n] their routed weights.
    up(gate_up [n, 2F]) = activation(gate_up + b13) [n, F];
    down(y [n, D]) = (y + b2) * routed weight (the bias first, as in gpt-oss), in place."""

    def up(gate_up_n2):
        if b13 is not None:
            gate_up_n2 = gate_up_n2.add_(b13)
        return gated_activation(gate_up_n2, activation, alpha, limit)

    def down(y_nD):
        if b2 is not None:
            y_nD = y_nD.add_(b2)
        return y_nD.mul_(weights_n[:, None].to(y_nD.dtype))

    return up, down


def _sorted_loop(x_TD, w13_EFD, w2_EDF, weights_R, ids_R, K, extra=None):
    """Rows sorted by expert once; per expert with rows: two GEMMs and one index_add.
    extra: None, or (w13_bias, w2_bias in fp32, activation, alpha, limit) (see _epilogues)."""
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
        if extra is not None:
            b13, b2, *act = extra
            up, down = _epilogues(None if b13 is None else b13[e], None if b2 is None else b2[e],
                                  weights_sorted_R[start:start + n], *act)
            out_TD.index_add_(0, tokens_n, down(torch.mm(up(gate_up_n2), w2_EDF[e].t())))
            start += n
            continue
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
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """Same contract as kernels.reference.fused_experts_torch (shapes checked by the seam).

    fp32 activations accumulate in fp32 as the reference does; fp16/bf16 ones (rare on the CPU)
    go through the reference, which computes the routed sum in fp32. Biases / "swigluoai": the
    grouped GEMM or the sorted loop, never the native kernel.
    """
    check_activation(activation)
    new_args = w13_bias is not None or w2_bias is not None or activation != "silu"
    if x_TD.is_cuda or x_TD.dtype != torch.float32:
        from kernels.reference import fused_experts_torch
        return fused_experts_torch(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, expert_map_E,
                                   w13_bias=w13_bias, w2_bias=w2_bias, activation=activation,
                                   swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    extra = None  # (b13 fp32, b2 fp32, activation, alpha, limit) when the call has any of them
    if new_args:
        extra = (None if w13_bias is None else w13_bias.float(), None if w2_bias is None else w2_bias.float(),
                 activation, swiglu_alpha, swiglu_limit)
    K = topk_ids_TK.shape[1]
    ids_R = _route(topk_ids_TK, expert_map_E)
    weights_R = topk_weights_TK.reshape(-1)
    # The grouped GEMM wants 16-byte aligned strides: D and F multiples of 4 fp32 elements.
    aligned = x_TD.shape[1] % 4 == 0 and w2_EDF.shape[2] % 4 == 0 and x_TD.stride(1) == 1
    if extra is None and ids_R.numel() <= GROUPED_MAX_ROWS:
        native = native_ops.experts(x_TD, w13_EFD, w2_EDF, weights_R.float(), ids_R, K)
        if native is not None:
            return native
    if HAVE_GROUPED_MM and aligned and ids_R.numel() <= GROUPED_MAX_ROWS:
        return _grouped(x_TD, w13_EFD, w2_EDF, weights_R, ids_R, K, extra)
    return _sorted_loop(x_TD, w13_EFD, w2_EDF, weights_R, ids_R, K, extra)
