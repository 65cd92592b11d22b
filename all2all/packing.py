"""Byte rows that carry a token and its routing metadata in one collective.

Legend: T tokens, N packed rows, R received rows, D hidden, K top-k, B bytes per packed row,
W words (8/4/2/1-byte units) of a row's x part, M = 2K metadata int32 per row.

A packed row is [ x (D * itemsize bytes) | pad to 16 | weights (K float32) | ids (K int32) | pad ],
its length a multiple of 16 bytes so that every row of the receive buffer, and therefore every
row of the `x_RD` view handed to the expert kernel, starts 16-byte aligned, and the metadata can
be read as int32/float32 in place. Sending the metadata in the same rows saves one collective per
dispatch, which at small batches is most of the cost (BENCHMARKS.md §3).

Copies into and out of packed rows go through the widest integer view that divides the row
(int64 for bf16 D=7168): a uint8 view would make every copy/gather kernel move one byte per
element, several times slower than the same bytes as int64 at large T.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 16
_META_ITEM = 4  # float32 weight, int32 id
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


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
    def meta_offset(self) -> int:
        return _round_up(self.x_bytes, _ALIGN)

    @property
    def row_bytes(self) -> int:
        return _round_up(self.meta_offset + 2 * _META_ITEM * self.top_k, _ALIGN)

    @property
    def word_bytes(self) -> int:
        """Widest word (<= 8 bytes) that divides the x part of a row."""
        return next(w for w in (8, 4, 2, 1) if self.x_bytes % w == 0)

    def empty(self, rows: int, device: torch.device) -> torch.Tensor:
        """[rows, B] uint8 uninitialised buffer."""
        return torch.empty(rows, self.row_bytes, dtype=torch.uint8, device=device)

    # Views of a [N, B] uint8 buffer (rows may be any slice of a buffer from `empty`).
    def x_view(self, buf_NB: torch.Tensor) -> torch.Tensor:
        """[N, D] activations, row stride B / itemsize (no copy)."""
        return buf_NB[:, :self.x_bytes].view(self.dtype)

    def x_words(self, buf_NB: torch.Tensor) -> torch.Tensor:
        """[N, W] the x part as words (no copy)."""
        return buf_NB[:, :self.x_bytes].view(_WORDS[self.word_bytes])

    def meta_view(self, buf_NB: torch.Tensor) -> torch.Tensor:
        """[N, 2K] int32: weights (float32 bits) then ids (no copy)."""
        o = self.meta_offset
        return buf_NB[:, o:o + 2 * _META_ITEM * self.top_k].view(torch.int32)

    def words_of(self, x_TD: torch.Tensor) -> torch.Tensor:
        """[T, W] view of activations as the same words as `x_words` (contiguous copy if needed)."""
        x_TD = x_TD.contiguous()
        w = self.word_bytes
        if x_TD.numel() and x_TD.data_ptr() % w:  # a misaligned slice of a larger tensor
            x_TD = x_TD.clone()
        return x_TD.view(torch.uint8).view(_WORDS[w]) if x_TD.numel() else \
            torch.empty(x_TD.shape[0], self.x_bytes // w, dtype=_WORDS[w], device=x_TD.device)


def pack_rows(layout: RowLayout, out_NB: torch.Tensor, x_TD: torch.Tensor,
              weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> None:
    """out_NB[:T] = x rows in order with their metadata (3 copy kernels, no temporaries)."""
    T = x_TD.shape[0]
    if T == 0:
        return
    rows = out_NB[:T]
    layout.x_words(rows).copy_(layout.words_of(x_TD))
    meta = layout.meta_view(rows)
    K = layout.top_k
    meta[:, :K].view(torch.float32).copy_(weights_TK)
    meta[:, K:].copy_(ids_TK)


def unpack_rows(layout: RowLayout, buf_RB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_RD view, weights_RK float32 view, ids_RK int32 view) of received rows; no copies.

    The metadata views are row-strided; callers make the dense tensors they hand out.
    """
    meta = layout.meta_view(buf_RB)
    K = layout.top_k
    return layout.x_view(buf_RB), meta[:, :K].view(torch.float32), meta[:, K:]
