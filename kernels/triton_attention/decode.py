"""Split-KV paged decode attention (flash-decoding), CUDA-graph capturable.
Reference: the decode branch of kernels.attention.paged_attention_torch.

Legend: B sequences (one query each), H query heads, G KV heads, HG = H // G, d head dim,
N cache blocks, S block size, P splits of the context.

Row b of q is sequence b's newest token at position seq_lens[b] - 1; it sees keys
key_start(seq_lens[b] - 1) .. seq_lens[b] - 1 (its chunk or sliding window, or all; see
kernels/attention.py). Program (b, g, s) takes the s-th of P equal
parts of that range (whole key tiles), loads each K/V tile once for all HG query heads of KV
head g (one tl.dot of the [HG padded to >= 16, d] query group), and writes its normalised
partial output and log2-sum-exp; a second kernel merges the P parts. With P = 1 the first
kernel writes the output directly. The grid and P depend only on shapes, never on values, and
parts past a sequence's end contribute nothing (lse = -inf), so a captured graph replays for any
seq_lens; rows with seq_lens 0 (padding) get zeros.

Inside a mixed batch (query_start_loc given: sequence b owns rows qsl[b] .. qsl[b+1]-1 of T), the
programs of sequences with one query read and write that row and the others return at once: the
decode rows of a mixed step keep this kernel's 16-row tiles, and the unified kernel
(unified.py) takes the rest.

With few splits (P <= FUSED_MERGE_MAX_SPLITS) the last program of each (b, g) to finish merges
its HG heads' P parts (kernels/last_program.py) instead of a second launch; with more, the merge
is a program's serial tail that costs more than the merge kernel's launch (measured on an H200,
BENCHMARKS.md §2). MOE_DECODE_FUSED_MERGE=0 keeps the merge kernel everywhere, and
MOE_DECODE_MAX_SPLITS caps P (A/B runs).

With PREFETCH (small batches, kernels/l2_prefetch.py) the programs of KV head 0 ask L2 for the
whole cache blocks (every KV head, K and V) of their split before the PDL wait: seq_lens and the
block tables are step inputs written before the forward, so the addresses are final then. The
keys then come from L2 instead of HBM; the newest one, which the kernel before writes, is read
after the wait as ever (a prefetch never changes what a load returns).

An FP8 cache (kernels/attention.py's docstring) is read as fp8 and widened to q's dtype in
registers (exact); k_scale is folded into the host-side score scale and v_scale multiplies each
split's normalised output (SCALE_V, a constexpr: other caches compile the kernel as before).

Attention sinks (USE_SINKS) enter once per head, as one more part of log2-sum-exp s_h * log2(e)
and output zero: in the merge (fused or the merge kernel), or with P = 1 before the one
normalisation; the splits themselves attend over keys only.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.attention import check_local, check_sinks, is_fp8_kv
from kernels.l2_prefetch import bulk_prefetch_supported, l2_prefetch_lanes
from kernels.last_program import zeroed_counters
from kernels.pdl import pdl_enter, pdl_launch
from kernels.triton_attention.common import (
    LOG2E,
    LOG2E_JIT,
    NEG_BIG,
    attend_key_tile,
    check_block_tables,
    check_cache,
    dot_flags,
    head_dim_pad,
    join_sink,
)

NUM_SMS_H200 = 132
FUSED_MERGE = os.environ.get("MOE_DECODE_FUSED_MERGE", "1") != "0"
# In a decode graph (H200, Qwen3-30B-A3B): 3 splits at batch 32 merged in the last program saved
# 0.22 ms a step; 16 splits at batch 1 cost 0.07 ms more than the merge kernel.
FUSED_MERGE_MAX_SPLITS = 4
MAX_SPLITS = int(os.environ.get("MOE_DECODE_MAX_SPLITS", "64"))
# KV blocks are prefetched into L2 up to this many sequences (the whole KV of a large batch would
# not stay in L2); in a batch-1 decode graph on an H200 it saved 0.03 ms a step (BENCHMARKS.md §2).
# MOE_DECODE_PREFETCH=0: never (A/B runs).
PREFETCH_MAX_SEQS = 16 if os.environ.get("MOE_DECODE_PREFETCH", "1") != "0" else 0
NUM_WARPS = 4


@triton.jit
def _sink_log2(sinks_ptr, head, ok):
    """The sink logits of the query heads `head` in log2 units (-inf where not ok: no sink)."""
    return tl.load(sinks_ptr + head, mask=ok, other=float("-inf")).to(tl.float32) * LOG2E_JIT


@triton.jit
def _split_keys(seq_lens_ptr, b, split, chunk_size, window, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                USE_CHUNK: tl.constexpr, USE_WINDOW: tl.constexpr):
    """(L, k_begin, k_end): sequence b's length and the keys of its split (whole tiles, so every
    split but the last few has the same work)."""
    L = tl.load(seq_lens_ptr + b)
    if USE_CHUNK:
        k_lo = (tl.maximum(L - 1, 0) // chunk_size) * chunk_size
    elif USE_WINDOW:  # the one query row L - 1 sees its last `window` keys
        k_lo = tl.maximum(L - window, 0)
    else:
        k_lo = L * 0
    tiles = tl.cdiv(L - k_lo, BLOCK_N)
    per_split = tl.cdiv(tiles, NUM_SPLITS) * BLOCK_N
    k_begin = k_lo + split * per_split
    return L, k_begin, tl.minimum(k_begin + per_split, L)


@triton.jit
def _decode_split_kernel(q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, o_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
                         sinks_ptr, stride_qb, stride_qh, stride_ob, stride_oh, stride_btb, stride_btm,
                         v_offset, stride_blk, stride_tok, scale_log2, chunk_size, window, v_scale,
                         HG: tl.constexpr, HG_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, S: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, USE_CHUNK: tl.constexpr, USE_WINDOW: tl.constexpr,
                         USE_SINKS: tl.constexpr, FUSED_MERGE: tl.constexpr,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
                         PREFETCH: tl.constexpr, LANES: tl.constexpr, MIXED: tl.constexpr,
                         SCALE_V: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = b
    if MIXED:  # see the module docstring; PREFETCH is off
        row = tl.load(qsl_ptr + b)
        if tl.load(qsl_ptr + b + 1) - row != 1:
            return
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb
    if PREFETCH:  # before the wait: see the module docstring
        if kv_head == 0:
            _, pf_begin, pf_end = _split_keys(seq_lens_ptr, b, split, chunk_size, window, BLOCK_N, NUM_SPLITS,
                                              USE_CHUNK, USE_WINDOW)
            blk_bytes = stride_blk * kv_ptr.dtype.element_ty.primitive_bitwidth // 8
            last = tl.cdiv(pf_end, S)
            for j0 in range(pf_begin // S, last, LANES):
                j = j0 + tl.arange(0, LANES)
                ok = j < last
                blk = tl.load(bt_row_ptr + j * stride_btm, mask=ok, other=0).to(tl.int64)
                nbytes = tl.where(ok, blk_bytes, 0)
                l2_prefetch_lanes(kv_ptr + blk * stride_blk, nbytes)
                l2_prefetch_lanes(kv_ptr + v_offset + blk * stride_blk, nbytes)
    pdl_enter(USE_PDL)
    L, k_begin, k_end = _split_keys(seq_lens_ptr, b, split, chunk_size, window, BLOCK_N, NUM_SPLITS, USE_CHUNK,
                                    USE_WINDOW)

    r = tl.arange(0, HG_PAD)
    head = kv_head * HG + r
    row_ok = r < HG
    dd = tl.arange(0, D_PAD)
    d_ok = dd < HEAD_DIM
    q_off = row.to(tl.int64) * stride_qb + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qpos = r * 0 + (L - 1)

    acc = tl.zeros([HG_PAD, D_PAD], dtype=tl.float32)
    m_i = tl.full([HG_PAD], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([HG_PAD], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_N):
        acc, m_i, l_i = attend_key_tile(acc, m_i, l_i, q, kv_ptr, bt_row_ptr, stride_btm, kv_head, v_offset,
                                        stride_blk, stride_tok, k0, qpos, qpos, k_end, scale_log2, dd,
                                        S, BLOCK_N, HEAD_DIM, D_PAD, True, False, PRECISION, UPCAST)
    if USE_SINKS and NUM_SPLITS == 1:  # with more splits: in the merge
        acc, m_i, l_i = join_sink(acc, m_i, l_i, _sink_log2(sinks_ptr, head, row_ok))
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]  # an empty split leaves acc = 0
    if SCALE_V:  # an FP8 cache's v_scale (the merge is linear in the parts)
        out = out * v_scale
    if NUM_SPLITS == 1:
        o_off = row.to(tl.int64) * stride_ob + head * stride_oh
        tl.store(o_ptr + o_off[:, None] + dd[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        # part_o: [B, H, P, D_PAD] fp32, part_lse: [B, H, P] fp32 (log2 units)
        part = (b.to(tl.int64) * (HG * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(part_o_ptr + part[:, None] * D_PAD + dd[None, :], out, mask=row_ok[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        if FUSED_MERGE:
            tl.debug_barrier()  # every thread's part is stored before the count says so
            count_ptr = counter_ptr + b * tl.num_programs(1) + kv_head
            if tl.atomic_add(count_ptr, 1, sem="acq_rel") == NUM_SPLITS - 1:
                first = part - split
                o_off = row.to(tl.int64) * stride_ob + head * stride_oh
                _merge_parts(part_o_ptr, part_lse_ptr, o_ptr, first, o_off, row_ok, dd, d_ok, sinks_ptr, head,
                             HG_PAD, D_PAD, NUM_SPLITS, USE_SINKS)
                tl.atomic_xchg(count_ptr, 0)  # ready for the next launch


@triton.jit
def _merge_parts(part_o_ptr, part_lse_ptr, o_ptr, first, o_off, row_ok, dd, d_ok, sinks_ptr, head,
                 HG_PAD: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_SINKS: tl.constexpr):
    """Online log-sum-exp merge of the NUM_SPLITS parts of HG heads (part s of head i at
    first[i] + s), read at L2 (".cg": other programs wrote them); USE_SINKS: then the heads' sinks
    as one more part of output zero."""
    m = tl.full([HG_PAD], NEG_BIG, dtype=tl.float32)
    total = tl.zeros([HG_PAD], dtype=tl.float32)
    acc = tl.zeros([HG_PAD, D_PAD], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        lse = tl.load(part_lse_ptr + first + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(part_o_ptr + (first + s)[:, None] * D_PAD + dd[None, :], mask=row_ok[:, None],
                       other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)  # NEG_BIG while every part so far was empty
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m_new))
        alpha = tl.exp2(m - m_new)
        acc = acc * alpha[:, None] + part * w[:, None]
        total = total * alpha + w
        m = m_new
    if USE_SINKS:
        acc, m, total = join_sink(acc, m, total, _sink_log2(sinks_ptr, head, row_ok))
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]  # every part empty (seq_lens 0): zeros
    tl.store(o_ptr + o_off[:, None] + dd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_merge_kernel(part_o_ptr, part_lse_ptr, o_ptr, qsl_ptr, sinks_ptr, stride_ob, stride_oh, H,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, P_PAD: tl.constexpr, USE_PDL: tl.constexpr,
                         MIXED: tl.constexpr, USE_SINKS: tl.constexpr):
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b
    if MIXED:
        row = tl.load(qsl_ptr + b)
        if tl.load(qsl_ptr + b + 1) - row != 1:
            return
    s = tl.arange(0, P_PAD)
    dd = tl.arange(0, D_PAD)
    base = (b.to(tl.int64) * H + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    if USE_SINKS:  # the sink: one more part of output zero
        sink = tl.load(sinks_ptr + h).to(tl.float32) * LOG2E_JIT
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # every part empty (seq_lens 0): weights all 0
    w = tl.exp2(lse - m)
    parts = tl.load(part_o_ptr + (base + s)[:, None] * D_PAD + dd[None, :],
                    mask=(s[:, None] < NUM_SPLITS), other=0.0)
    total = tl.sum(w, 0)
    if USE_SINKS:
        total += tl.exp2(sink - m)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + row.to(tl.int64) * stride_ob + h * stride_oh + dd, out.to(o_ptr.dtype.element_ty),
             mask=dd < HEAD_DIM)


def default_num_splits(B: int, G: int, max_keys: int, block_n: int) -> int:
    """Enough splits for about two programs per SM, but at least 4 key tiles per split."""
    want = triton.cdiv(2 * NUM_SMS_H200, max(B * G, 1))
    most = max(1, triton.cdiv(max_keys, 4 * block_n))
    return max(1, min(want, most, MAX_SPLITS))


def paged_attention_decode_triton(q_BHd: torch.Tensor, kv_cache_2NSGd: torch.Tensor,
                                  block_tables_BM: torch.Tensor, seq_lens_B: torch.Tensor, scale: float,
                                  chunk_size: int | None = None, out_BHd: torch.Tensor | None = None,
                                  num_splits: int | None = None, block_n: int | None = None,
                                  fused_merge: bool | None = None,
                                  query_start_loc_B1: torch.Tensor | None = None,
                                  k_scale: float = 1.0, v_scale: float = 1.0, *, sliding_window: int | None = None,
                                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence over its paged context; returns out_BHd [B, H, d] in q's dtype.

    q_BHd: [B, H, d] fp32/fp16/bf16, any strides with a unit stride along d.
    kv_cache_2NSGd: contiguous [2, N, S, G, d] (fp32/fp16/bf16, or FP8 read with the host floats
    k_scale / v_scale, which other caches ignore); block_tables_BM: [B, max_blocks] int32/int64;
    seq_lens_B: [B] int32/int64 (0 = padded row: zeros out, nothing read).
    num_splits: None = chosen from B * G and max_blocks (static shapes only).
    block_n: keys per tile (power of two >= 16); None = 64 for d <= 128 (tests use 16).
    fused_merge: merge the splits in the last program of each (sequence, KV head) instead of a
    second launch; None = with at most FUSED_MERGE_MAX_SPLITS splits (MOE_DECODE_FUSED_MERGE=0: never).
    query_start_loc_B1: [B+1] on the device for a mixed batch: q and out_BHd are then [T, H, d]
    (any T) and only the rows of the sequences with one query are written (module docstring).
    sliding_window: the query sees its last sliding_window keys (not with chunk_size).
    sinks: fp32 [H] on the device, each head's sink logit (kernels/attention.py); None = none.
    """
    if q_BHd.dim() != 3 or q_BHd.stride(2) != 1:
        raise ValueError(f"q_BHd must be [B, H, d] with unit stride along d, got {tuple(q_BHd.shape)}")
    B, H, d = q_BHd.shape
    mixed = query_start_loc_B1 is not None
    if mixed:
        B = seq_lens_B.shape[0]
        if query_start_loc_B1.shape != (B + 1,):
            raise ValueError(f"query_start_loc_B1 must be [B+1={B + 1}], got {tuple(query_start_loc_B1.shape)}")
    S, G = check_cache(kv_cache_2NSGd, d)
    check_block_tables(block_tables_BM, B)
    if seq_lens_B.shape != (B,):
        raise ValueError(f"seq_lens_B must be [B={B}], got {tuple(seq_lens_B.shape)}")
    if H % G:
        raise ValueError(f"query heads {H} must be a multiple of KV heads {G}")
    check_local(chunk_size, sliding_window)
    sinks = check_sinks(sinks, H, q_BHd.device)
    if out_BHd is None:
        out_BHd = torch.empty_like(q_BHd)
    elif out_BHd.shape != q_BHd.shape or out_BHd.stride(2) != 1:
        raise ValueError(f"out_BHd must be [B, H, d] = {tuple(q_BHd.shape)} with unit stride along d")
    if B == 0:
        return out_BHd
    d_pad = head_dim_pad(d)
    if block_n is None:
        block_n = 64 if d_pad <= 128 else 32
    max_keys = block_tables_BM.shape[1] * S
    if chunk_size is not None or sliding_window is not None:
        max_keys = min(max_keys, chunk_size or sliding_window)
    if num_splits is None:
        num_splits = default_num_splits(B, G, max_keys, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    hg = H // G
    precision, upcast = dot_flags(q_BHd.dtype)
    N = kv_cache_2NSGd.shape[1]
    if fused_merge is None:
        fused_merge = FUSED_MERGE and num_splits <= FUSED_MERGE_MAX_SPLITS
    fused_merge = num_splits > 1 and fused_merge
    if num_splits > 1:
        part_o = torch.empty(B, H, num_splits, d_pad, dtype=torch.float32, device=q_BHd.device)
        part_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q_BHd.device)
    else:
        part_o = part_lse = out_BHd  # unused
    counters = zeroed_counters("decode_merge", B * G, q_BHd.device) if fused_merge else seq_lens_B  # unused without
    prefetch = not mixed and B <= PREFETCH_MAX_SEQS and bulk_prefetch_supported(q_BHd)
    fp8 = is_fp8_kv(kv_cache_2NSGd.dtype)
    scale_log2 = scale * LOG2E * k_scale if fp8 else scale * LOG2E
    _decode_split_kernel[(B, G, num_splits)](
        q_BHd, kv_cache_2NSGd, block_tables_BM, seq_lens_B, query_start_loc_B1 if mixed else seq_lens_B, out_BHd,
        part_o, part_lse, counters, seq_lens_B if sinks is None else sinks,  # unused without sinks
        q_BHd.stride(0), q_BHd.stride(1), out_BHd.stride(0), out_BHd.stride(1),
        block_tables_BM.stride(0), block_tables_BM.stride(1),
        N * S * G * d, S * G * d, G * d, scale_log2, chunk_size or 1, sliding_window or 1, float(v_scale),
        HG=hg, HG_PAD=max(16, triton.next_power_of_2(hg)), HEAD_DIM=d, D_PAD=d_pad, BLOCK_N=block_n, S=S,
        NUM_SPLITS=num_splits, USE_CHUNK=chunk_size is not None, USE_WINDOW=sliding_window is not None,
        USE_SINKS=sinks is not None, FUSED_MERGE=fused_merge,
        PRECISION=precision, UPCAST=upcast, PREFETCH=prefetch, LANES=32 * NUM_WARPS, MIXED=mixed, SCALE_V=fp8,
        num_warps=NUM_WARPS, num_stages=3, **pdl_launch(q_BHd))
    if num_splits > 1 and not fused_merge:
        _decode_merge_kernel[(B, H)](
            part_o, part_lse, out_BHd, query_start_loc_B1 if mixed else seq_lens_B,
            seq_lens_B if sinks is None else sinks, out_BHd.stride(0), out_BHd.stride(1), H, HEAD_DIM=d, D_PAD=d_pad,
            NUM_SPLITS=num_splits, P_PAD=triton.next_power_of_2(num_splits), MIXED=mixed, USE_SINKS=sinks is not None,
            num_warps=4, **pdl_launch(out_BHd))
    return out_BHd
