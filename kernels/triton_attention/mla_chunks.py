"""MLA's prefill chunks in the absorbed form, the query tokens of a chunk packed into one program.

In a mixed step's CUDA graph every MLA query row runs absorbed (models/layers/mla_attention.py).
The split-KV decode kernel gives each token a program of its own: a chunk's tokens then read the
same cache rows once each, and a program's tl.dot has only its BLOCK_H heads as rows (16 for
DeepSeek-V3 at TP=8 or Moonlight). Here a program takes BQ consecutive tokens of one chunk times
BLOCK_H heads, BQ * BLOCK_H rows against each [BLOCK_N, C] tile of the sequence's cache rows (the
values are the latent part of that same tile), a row seeing the keys up to its own position.
No split of the keys: a chunk has tiles enough to fill the GPU.

Grid (T // BQ + B, head tiles), shapes only, so a CUDA graph replays it for any layout: tile slot
j belongs to the last sequence b with query_start_loc[b] // BQ + b <= j (unified.py's numbering
and binary search). Sequences of one token (decode rows, graph padding) and spare slots return at
once, as do a graph's padding sequences (context 0): the decode kernel (mla_decode.py), which runs
first, writes their rows.

Reference: kernels/mla_attention.py (`mla_absorbed_torch`). Legend as mla_decode.py's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import is_fp8_kv
from kernels.pdl import pdl_enter, pdl_launch
from kernels.triton_attention.mla_decode import _LOG2E, _dot, _interpreting, _pow2
from kernels.triton_attention.unified import _find_tile


@triton.jit(do_not_specialize=["B", "stride_tb"])
def _mla_chunks_kernel(
    q_ptr, cache_ptr, tables_ptr, qsl_ptr, lens_ptr, out_ptr, B,
    H, R, P, qk_scale, stride_qt, stride_qh, stride_cn, stride_cs, stride_tb, stride_ot, stride_oh, kv_scale,
    S: tl.constexpr, BQ: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr,
    P_PAD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr, SCALED: tl.constexpr,
):
    pdl_enter(USE_PDL)
    b, tile = _find_tile(qsl_ptr, B, tl.program_id(0), BQ)
    if b >= B:
        return
    first = tl.load(qsl_ptr + b)
    n = tl.load(qsl_ptr + b + 1) - first
    seq_len = tl.load(lens_ptr + b)
    # a decode row (the decode kernel's), a spare slot, or a graph's padding sequence (context 0)
    if n <= 1 or tile * BQ >= n or seq_len < n:
        return
    offs_m = tl.arange(0, BQ * BLOCK_H)  # row m: token tile * BQ + m // BLOCK_H, head m % BLOCK_H
    token = tile * BQ + offs_m // BLOCK_H
    head = tl.program_id(1) * BLOCK_H + offs_m % BLOCK_H
    row_ok = (token < n) & (head < H)
    pos = seq_len - n + token  # the row's position: it sees keys 0 .. pos (rows past the chunk: unused)
    offs_r = tl.arange(0, R_PAD)
    offs_p = tl.arange(0, P_PAD)
    r_mask = offs_r < R
    p_mask = offs_p < P

    q_rows = q_ptr + (first + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_r[None, :], mask=row_ok[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(q_rows + R + offs_p[None, :], mask=row_ok[:, None] & p_mask[None, :], other=0.0)

    m_i = tl.full([BQ * BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BQ * BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BQ * BLOCK_H, R_PAD], dtype=tl.float32)
    end = tl.minimum(seq_len - n + tile * BQ + BQ, seq_len)  # the tile's last token's keys
    table_row = tables_ptr + b.to(tl.int64) * stride_tb
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block_id = tl.load(table_row + offs_n // S, mask=n_mask, other=0).to(tl.int64)
        rows = cache_ptr + block_id * stride_cn + (offs_n % S) * stride_cs
        k_lat = tl.load(rows[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        k_pe = tl.load(rows[:, None] + R + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :], other=0.0)
        k_lat = k_lat.to(q_lat.dtype)
        k_pe = k_pe.to(q_lat.dtype)
        s = _dot(q_lat, tl.trans(k_lat), tl.zeros([BQ * BLOCK_H, BLOCK_N], dtype=tl.float32), PRECISION, UPCAST)
        s = _dot(q_pe, tl.trans(k_pe), s, PRECISION, UPCAST) * qk_scale
        # key 0 is every row's (pos >= 0), so no row's maximum stays -inf after the first tile
        s = tl.where(n_mask[None, :] & (offs_n[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new

    acc = acc / l_i[:, None]
    if SCALED:  # an FP8 cache's scale on the values (the latents)
        acc = acc * kv_scale
    dst = out_ptr + (first + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_r[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & r_mask[None, :])


def chunk_tiles(H: int, rows: int = 64) -> tuple[int, int]:
    """(BQ, BLOCK_H): heads per program up to `rows`, then as many tokens as fill `rows` rows."""
    block_h = min(_pow2(H), rows)
    return max(1, rows // block_h), block_h


def mla_chunks_triton(q_THC: torch.Tensor, cache_NSC: torch.Tensor, block_tables_BM: torch.Tensor,
                      query_start_loc_B1: torch.Tensor, seq_lens_B: torch.Tensor, scale: float, kv_lora_rank: int,
                      out_THR: torch.Tensor, kv_scale: float = 1.0, rows: int = 64) -> torch.Tensor:
    """Absorbed-form attention of the query rows of every sequence with more than one new token
    (a sequence's new tokens are the last ones of its seq_lens_B keys), written into out_THR
    [T, H, R]; the rows of one-token sequences are left as they are. q_THC = [q_nope @ W_UK | q_pe];
    softmax in fp32; kv_scale: an FP8 cache's scale. rows: tokens x heads a program (a power of two)."""
    if q_THC.dim() != 3 or cache_NSC.dim() != 3 or out_THR.dim() != 3:
        raise ValueError(f"q, cache and out must be 3-D; got {tuple(q_THC.shape)}, {tuple(cache_NSC.shape)}, "
                         f"{tuple(out_THR.shape)}")
    T, H, C = q_THC.shape
    R, B = kv_lora_rank, seq_lens_B.shape[0]
    if cache_NSC.shape[2] != C or not 0 < R < C or out_THR.shape != (T, H, R):
        raise ValueError(f"q {tuple(q_THC.shape)}, cache row {cache_NSC.shape[2]}, out {tuple(out_THR.shape)} and "
                         f"kv_lora_rank {R} do not match")
    if query_start_loc_B1.shape != (B + 1,) or block_tables_BM.dim() != 2 or block_tables_BM.shape[0] < B:
        raise ValueError(f"query_start_loc {tuple(query_start_loc_B1.shape)} / block tables "
                         f"{tuple(block_tables_BM.shape)} do not match {B} sequences")
    if q_THC.stride(2) != 1 or cache_NSC.stride(2) != 1 or block_tables_BM.stride(1) != 1 or out_THR.stride(2) != 1:
        raise ValueError("q, cache, block tables and out must be contiguous in their last dim")
    if rows < 16 or rows & (rows - 1):
        raise ValueError(f"rows (tokens x heads a program, MOE_MLA_CHUNK_ROWS) must be a power of two >= 16: {rows}")
    if T == 0 or B == 0:
        return out_THR
    block_q, block_h = chunk_tiles(H, rows)
    R_PAD, P_PAD = _pow2(R), _pow2(C - R)
    fp8 = is_fp8_kv(cache_NSC.dtype)
    _mla_chunks_kernel[(T // block_q + B, triton.cdiv(H, block_h))](
        q_THC, cache_NSC, block_tables_BM, query_start_loc_B1, seq_lens_B, out_THR, B,
        H, R, C - R, scale * _LOG2E * kv_scale if fp8 else scale * _LOG2E,
        q_THC.stride(0), q_THC.stride(1), cache_NSC.stride(0), cache_NSC.stride(1), block_tables_BM.stride(0),
        out_THR.stride(0), out_THR.stride(1), float(kv_scale),
        S=cache_NSC.shape[1], BQ=block_q, BLOCK_H=block_h, BLOCK_N=32 if R_PAD >= 512 else 64, R_PAD=R_PAD,
        P_PAD=P_PAD, PRECISION="ieee" if q_THC.dtype == torch.float32 else "tf32",
        UPCAST=_interpreting() and q_THC.dtype != torch.float32, SCALED=fp8, num_warps=8 if R_PAD >= 256 else 4,
        num_stages=2, **pdl_launch(q_THC))
    return out_THR
