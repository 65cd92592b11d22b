"""Variable-length paged attention over a whole batch in one launch (prefill, chunked prefill,
prefix-cache hits, and decode rows of a mixed batch). Reference: kernels.attention.paged_attention_torch.

Legend: T query tokens, B sequences, H query heads, G KV heads, d head dim, N cache blocks,
S block size, M rows of a query tile, n_b queries and L_b context tokens of sequence b.

Sequence b owns query rows query_start_loc[b] .. query_start_loc[b+1]-1; query i sits at position
L_b - n_b + i and sees keys key_start(pos) .. pos, all read from the cache through the block
table (the new tokens' K/V are written there first). A program handles one sequence, one tile of
queries and HPP query heads of one KV group: its M = QPT * HPP rows are (query, head) pairs, so a
K/V tile is loaded once for all those heads, and a decode row (n_b = 1) still fills HPP rows.
Key tiles entirely visible to every row of the tile run without masks; only the last few
(the causal diagonal, chunk edges) and, under a sliding window, the first few (where the rows'
windows start) are masked. Sinks (kernels/attention.py) join each row's softmax after the last
key tile. An FP8 cache: as decode.py's docstring says.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention import check_local, check_sinks, is_fp8_kv
from kernels.pdl import pdl_enter, pdl_launch
from kernels.triton_attention.common import (
    LOG2E,
    attend_context,
    check_block_tables,
    check_cache,
    dot_flags,
    head_dim_pad,
    heads_per_program,
)


@triton.jit
def _prefill_kernel(q_ptr, kv_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, o_ptr, sinks_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_btb, stride_btm,
                    v_offset, stride_blk, stride_tok, scale_log2, chunk_size, window, v_scale,
                    HG: tl.constexpr, HPP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, S: tl.constexpr,
                    USE_CHUNK: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr, SCALE_V: tl.constexpr):
    pdl_enter(USE_PDL)
    QPT: tl.constexpr = BLOCK_M // HPP  # queries per tile
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = tl.program_id(2)
    q_begin = tl.load(qsl_ptr + b)
    n = tl.load(qsl_ptr + b + 1) - q_begin
    L = tl.load(seq_lens_ptr + b)
    m0 = pid_m * QPT
    if m0 >= n:  # the grid covers the longest sequence of the batch
        return
    h0 = pid_h * HPP
    kv_head = h0 // HG
    r = tl.arange(0, BLOCK_M)
    qi = m0 + r // HPP
    head = h0 + r % HPP
    row_ok = (r < QPT * HPP) & (qi < n)
    qpos = L - n + qi
    dd = tl.arange(0, D_PAD)
    q_off = (q_begin + qi).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + dd[None, :],
                mask=row_ok[:, None] & (dd[None, :] < HEAD_DIM), other=0.0)

    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb
    # head: h0 + r % HPP, a valid head in every row (attend_context's sinks load needs no mask)
    out = attend_context(q, qpos, L - n + m0, QPT, L, chunk_size, window, kv_ptr, bt_row_ptr, stride_btm, kv_head,
                         v_offset, stride_blk, stride_tok, scale_log2, dd, sinks_ptr, head, BLOCK_M, S, BLOCK_N,
                         HEAD_DIM, D_PAD, USE_CHUNK, USE_WINDOW, USE_SINKS, PRECISION, UPCAST, False)
    if SCALE_V:  # an FP8 cache's v_scale (k_scale is in scale_log2)
        out = out * v_scale
    o_off = (q_begin + qi).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(o_ptr + o_off[:, None] + dd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dd[None, :] < HEAD_DIM))


def _launch_config(max_query_len: int, hpp: int, d_pad: int) -> dict:
    """Tile sizes for Hopper: M rows up to 128 (fewer when the batch's queries cannot fill them,
    e.g. decode rows), 64 keys per tile for d <= 128."""
    rows = max_query_len * hpp
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 or d_pad > 128 else 128
    block_m = max(block_m, triton.next_power_of_2(hpp))
    block_n = 64 if d_pad <= 128 else 32
    num_warps = 8 if block_m >= 128 else 4
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": 2}


def paged_attention_prefill_triton(q_THd: torch.Tensor, kv_cache_2NSGd: torch.Tensor,
                                   block_tables_BM: torch.Tensor, query_start_loc_B1: torch.Tensor,
                                   seq_lens_B: torch.Tensor, max_query_len: int, scale: float,
                                   chunk_size: int | None = None, out_THd: torch.Tensor | None = None,
                                   config: dict | None = None, k_scale: float = 1.0,
                                   v_scale: float = 1.0, *, sliding_window: int | None = None,
                                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (optionally chunked-local or sliding-window) GQA attention of each sequence's queries
    over its cached context; returns out_THd [T, H, d] in q's dtype.

    q_THd: [T, H, d] fp32/fp16/bf16, any strides with a unit stride along d.
    kv_cache_2NSGd: contiguous [2, N, S, G, d]; K/V are cast to q's dtype on load (an FP8 cache's
    scales: k_scale folded into the score scale, v_scale onto the output; other caches ignore them).
    block_tables_BM: [B, max_blocks] int32/int64. query_start_loc_B1: [B+1], seq_lens_B: [B]
    int32 or int64 (device). max_query_len: host int >= every sequence's query count (sizes the grid).
    config: optional override of BLOCK_M / BLOCK_N / num_warps / num_stages (tuning).
    sliding_window: a query at p sees keys max(0, p - sliding_window + 1) .. p (not with chunk_size).
    sinks: fp32 [H] on the device, each head's sink logit (kernels/attention.py); None = none.
    """
    if q_THd.dim() != 3 or q_THd.stride(2) != 1:
        raise ValueError(f"q_THd must be [T, H, d] with unit stride along d, got {tuple(q_THd.shape)}")
    T, H, d = q_THd.shape
    S, G = check_cache(kv_cache_2NSGd, d)
    B = seq_lens_B.shape[0]
    check_block_tables(block_tables_BM, B)
    if query_start_loc_B1.shape != (B + 1,):
        raise ValueError(f"query_start_loc_B1 must be [B+1={B + 1}], got {tuple(query_start_loc_B1.shape)}")
    check_local(chunk_size, sliding_window)
    sinks = check_sinks(sinks, H, q_THd.device)
    if out_THd is None:
        out_THd = torch.empty_like(q_THd)
    elif out_THd.shape != q_THd.shape or out_THd.stride(2) != 1:
        raise ValueError(f"out_THd must be [T, H, d] = {tuple(q_THd.shape)} with unit stride along d")
    if T == 0 or B == 0 or max_query_len <= 0:
        return out_THd
    d_pad = head_dim_pad(d)
    hpp = heads_per_program(H, G, cap=16)
    cfg = _launch_config(max_query_len, hpp, d_pad) if config is None else config
    qpt = cfg["BLOCK_M"] // hpp
    if qpt < 1:
        raise ValueError(f"BLOCK_M {cfg['BLOCK_M']} smaller than the {hpp} heads per program")
    precision, upcast = dot_flags(q_THd.dtype)
    N = kv_cache_2NSGd.shape[1]
    fp8 = is_fp8_kv(kv_cache_2NSGd.dtype)
    grid = (triton.cdiv(max_query_len, qpt), H // hpp, B)
    _prefill_kernel[grid](
        q_THd, kv_cache_2NSGd, block_tables_BM, query_start_loc_B1, seq_lens_B, out_THd,
        seq_lens_B if sinks is None else sinks,  # unused without sinks
        q_THd.stride(0), q_THd.stride(1), out_THd.stride(0), out_THd.stride(1),
        block_tables_BM.stride(0), block_tables_BM.stride(1),
        N * S * G * d, S * G * d, G * d, scale * LOG2E * k_scale if fp8 else scale * LOG2E, chunk_size or 1,
        sliding_window or 1, float(v_scale), HG=H // G, HPP=hpp, HEAD_DIM=d, D_PAD=d_pad, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], S=S, USE_CHUNK=chunk_size is not None, USE_WINDOW=sliding_window is not None,
        USE_SINKS=sinks is not None, PRECISION=precision, UPCAST=upcast, SCALE_V=fp8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(q_THd))
    return out_THd
