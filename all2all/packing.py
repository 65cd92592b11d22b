"""Byte rows that carry a token and its routing metadata in one collective.

Legend: T tokens, N packed rows, R received rows, D hidden, K top-k, B bytes per packed row.

A packed row is [ x (D * itemsize bytes) | weights (K float32) | ids (K int32) | pad ], its
length rounded up to 16 bytes so that every row of the receive buffer, and therefore every row
of the `x_RD` view handed to the expert kernel, starts 16-byte aligned. Sending the metadata in
the same rows saves one collective per dispatch, which at small batches is most of the cost
(TARGETS.md §2: a collective launch is tens of µs, the 128-token budget is 100 µs in all).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 16
_META_ITEM = 4  # float32 weight, int32 id


@dataclass(frozen=True)
class RowLayout:
    """Byte layout of one packed row (identical on every rank: D, dtype and K are global)."""

    hidden: int
    dtype: torch.dtype
    top_k: int

    @property
    def x_bytes(self) -> int:
        return self.hidden * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        raw = self.x_bytes + 2 * _META_ITEM * self.top_k
        return -(-raw // _ALIGN) * _ALIGN

    def empty(self, rows: int, device: torch.device) -> torch.Tensor:
        """[rows, B] uint8 uninitialised buffer."""
        return torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=device)


def _as_bytes(t_NX: torch.Tensor) -> torch.Tensor:
    return t_NX.contiguous().view(torch.uint8)


def pack_rows(
    layout: RowLayout,
    out_NB: torch.Tensor,
    x_TD: torch.Tensor,
    token_idx_N: torch.Tensor | None,
    weights_NK: torch.Tensor,
    ids_NK: torch.Tensor,
) -> None:
    """Fill `out_NB` (first N rows) with x rows and their metadata.

    Args:
        out_NB: [>= N, B] uint8 destination (rows past N are left untouched).
        x_TD: [T, D] activations, dtype `layout.dtype`.
        token_idx_N: [N] int64 source row of x for each packed row; None = rows 0..N-1 in order.
        weights_NK: [N, K] routed weights (converted to float32).
        ids_NK: [N, K] global expert ids (converted to int32).
    """
    n = weights_NK.shape[0]
    if n == 0:
        return
    xb, kb = layout.x_bytes, _META_ITEM * layout.top_k
    x_TB = _as_bytes(x_TD)
    if token_idx_N is None:
        out_NB[:n, :xb].copy_(x_TB[:n])
    else:
        # Gathers straight into the strided slice: no temporary [N, D] copy.
        torch.index_select(x_TB, 0, token_idx_N, out=out_NB[:n, :xb])
    out_NB[:n, xb:xb + kb].copy_(_as_bytes(weights_NK.to(torch.float32)))
    out_NB[:n, xb + kb:xb + 2 * kb].copy_(_as_bytes(ids_NK.to(torch.int32)))


def unpack_rows(layout: RowLayout, buf_RB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split received rows into (x_RD view, weights_RK float32, ids_RK int32).

    x_RD aliases `buf_RB` (row stride B / itemsize, no copy); the metadata, K values per row, is
    copied out to dense tensors.
    """
    xb, kb = layout.x_bytes, _META_ITEM * layout.top_k
    x_RD = buf_RB[:, :xb].view(layout.dtype)
    weights_RK = buf_RB[:, xb:xb + kb].contiguous().view(torch.float32)
    ids_RK = buf_RB[:, xb + kb:xb + 2 * kb].contiguous().view(torch.int32)
    return x_RD, weights_RK, ids_RK
