"""Thin collective shims shared by the backends: version-proof names and the gloo fallbacks.

Legend: P ranks of the group, N rows per rank, D row width.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and warns on the
# old names; the GPU machines run 2.11, which may only have the old ones. Same signatures.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Process-group backends whose reduce_scatter raised "not supported" once: older gloo builds
# have no reduce_scatter. The check happens before any byte moves and on every rank alike, so
# switching all ranks to the fallback after the first failure keeps them in lock-step.
_NO_REDUCE_SCATTER: set[str] = set()
_DIST_ERROR = getattr(dist, "DistError", ())  # timeouts, lost peers


def _single_process() -> bool:
    # A dispatcher built without torch.distributed is a group of one: every collective is a copy.
    return not (dist.is_available() and dist.is_initialized())


def all_gather_rows(out_PNX: torch.Tensor, in_NX: torch.Tensor, group) -> None:
    """out[p*N:(p+1)*N] = rank p's `in_NX` (same N on every rank)."""
    if _single_process():
        out_PNX.copy_(in_NX)
        return
    _all_gather_single(out_PNX, in_NX, group=group)


def all_to_all_rows(out_RX: torch.Tensor, in_SX: torch.Tensor, out_splits: list[int] | None,
                    in_splits: list[int] | None, group) -> None:
    """Rows in_SX[sum(in_splits[:p]) : ...] go to rank p; out rows arrive ordered by source rank.
    Splits None = equal chunks (the cheaper all-to-all, no per-peer size lists)."""
    if _single_process():
        out_RX.copy_(in_SX)
        return
    dist.all_to_all_single(out_RX, in_SX, out_splits, in_splits, group=group)


def reduce_scatter_rows(out_ND: torch.Tensor, in_PND: torch.Tensor, group) -> None:
    """out_ND = sum over ranks of in_PND[rank*N:(rank+1)*N]. `in_PND` is not modified."""
    if _single_process():
        out_ND.copy_(in_PND)
        return
    backend = str(dist.get_backend(group)) if _NO_REDUCE_SCATTER else ""
    if backend not in _NO_REDUCE_SCATTER:
        try:
            _reduce_scatter_single(out_ND, in_PND, group=group)
            return
        except (RuntimeError, NotImplementedError) as exc:
            # A real communication failure (timeout, peer gone) must surface, not be retried.
            if isinstance(exc, _DIST_ERROR) or "support" not in str(exc).lower():
                raise
            backend = str(dist.get_backend(group))
            _NO_REDUCE_SCATTER.add(backend)
    # Fallback for gloo builds without reduce_scatter: all_reduce moves P times the bytes, but
    # gloo is the CPU test/smoke path, where correctness matters and bandwidth does not.
    summed_PND = in_PND.clone()
    dist.all_reduce(summed_PND, group=group)
    n = out_ND.shape[0]
    rank = dist.get_rank(group)
    out_ND.copy_(summed_PND[rank * n:(rank + 1) * n])
