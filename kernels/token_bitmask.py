"""Grammar masks on the logits: the tokens a structured-output row may not sample get -inf.

Legend: B logits rows, V vocabulary, R masked rows (R <= B), W = ceil(V / 32) mask words.

The mask is llguidance's (and xgrammar's) packed format: int32 [R, W], bit t % 32 of word t // 32
set when token t is allowed. `apply_token_bitmask` writes in place, only the rows it is given:
the Triton kernel on CUDA (kernels/triton_fused/token_bitmask.py: stores -inf where a bit is 0 and
reads no logits), this torch reference elsewhere.
"""
from __future__ import annotations

import torch

from kernels.triton_fused import fused_kernels_serve

_SHIFTS = {}


def _shifts(device: torch.device) -> torch.Tensor:
    t = _SHIFTS.get(device)
    if t is None:
        t = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return t


def allowed_tokens_reference(bitmask_RW: torch.Tensor, V: int) -> torch.Tensor:
    """The mask unpacked: bool [R, V], True = allowed. Through the bytes of the int32 words
    (little-endian: byte t // 8 holds token t at bit t % 8), so the intermediate is [R, 4W, 8]
    uint8, a byte per token, not an int32 per token."""
    R = bitmask_RW.shape[0]
    bytes_RX = bitmask_RW.contiguous().view(torch.uint8)
    bits = (bytes_RX[:, :, None] >> _shifts(bitmask_RW.device)) & 1
    return bits.view(R, -1)[:, :V].bool()


def apply_token_bitmask_reference(logits_BV: torch.Tensor, rows_R: torch.Tensor, bitmask_RW: torch.Tensor) -> None:
    """logits_BV[rows_R[r], t] = -inf where token t is not allowed by mask row r (in place).

    logits_BV: float [B, V] (any float dtype; last dimension contiguous); rows_R: int64 [R], distinct
    rows of logits_BV; bitmask_RW: int32 [R, W], W >= ceil(V / 32) (bits past V are ignored)."""
    if rows_R.numel() == 0:
        return
    V = logits_BV.shape[1]
    allowed = allowed_tokens_reference(bitmask_RW, V)
    masked = logits_BV.index_select(0, rows_R).masked_fill_(~allowed, float("-inf"))
    logits_BV.index_copy_(0, rows_R, masked)


def apply_token_bitmask(logits_BV: torch.Tensor, rows_R: torch.Tensor, bitmask_RW: torch.Tensor) -> None:
    """apply_token_bitmask_reference's contract; the Triton kernel where it serves (CUDA)."""
    if fused_kernels_serve(logits_BV) and logits_BV.stride(1) == 1:
        from kernels.triton_fused.token_bitmask import apply_token_bitmask_triton
        apply_token_bitmask_triton(logits_BV, rows_R, bitmask_RW)
    else:
        apply_token_bitmask_reference(logits_BV, rows_R, bitmask_RW)
