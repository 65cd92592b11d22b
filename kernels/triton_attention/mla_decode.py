"""MLA attention in the absorbed form over the paged latent cache (decode rows, also those of a
mixed step's CUDA graph), and the latent-cache write.

Each row is one query over the first seq_lens[b] keys of its sequence: a decode step's
sequences, or a mixed step's tokens (table_rows: each token's sequence, mla_token_rows: its causal
length), which is how MLA's mixed steps run inside CUDA graphs. All H heads share the single latent
"KV head" (the cache rows [latent | k_pe]), so one program serves a tile of BLOCK_H heads: the
scores are tl.dot of [BLOCK_H, C] queries against [BLOCK_N, C] cache rows, done as an R part
plus a P part (C = 576 is no power of two; each part is padded to one with masks), and the
values are the very latent tile already loaded for the scores. Long contexts are split over
num_splits programs per (sequence, head tile); a merge kernel combines the partial results with
their log-sum-exp. The grid depends only on static shapes and nothing is read back to the host,
so the decode can be captured in a CUDA graph; rows with seq_len 0 (graph padding) give zeros.

Reference: kernels/mla_attention.py (`write_latent_cache`, `mla_absorbed_torch`).

An FP8 cache (one scale per layer for the whole row, kv_scale, as vLLM's MLA): the write quantises
in the kernel (kv_cache.py's to_cache_dtype); the decode widens the fp8 rows to q's dtype (exact),
with kv_scale folded into the host-side score scale and multiplied onto the latent output (SCALED,
a constexpr: other caches compile the kernels as before).

Legend: B sequences (= decode rows), H heads, R kv_lora_rank, P qk_rope_head_dim, C = R + P,
N cache blocks, S block size, M block-table width, T tokens, NS splits.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.attention import is_fp8_kv
from kernels.pdl import pdl_enter, pdl_launch
from kernels.triton_attention.kv_cache import fp8_max, quant_interpreted, to_cache_dtype

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64  # also the merge kernel's padded split count


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the CPU interpreter computes bf16 dots wrongly; fp32 is exact there
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _write_latent_kernel(src_ptr, cache_ptr, slot_ptr, C, stride_st, stride_cn, stride_cs, kv_scale,
                         S: tl.constexpr, BLOCK_C: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
                         INTERPRET: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padded row of a CUDA-graph batch
        return
    offs = tl.arange(0, BLOCK_C)
    mask = offs < C
    row = tl.load(src_ptr + t.to(tl.int64) * stride_st + offs, mask=mask)
    dst = cache_ptr + (slot // S) * stride_cn + (slot % S) * stride_cs + offs
    if QUANT:
        row = to_cache_dtype(row, kv_scale, cache_ptr.dtype.element_ty, QUANT, FP8_MAX, INTERPRET)
    tl.store(dst, row, mask=mask)


def write_latent_cache_triton(latent_TC: torch.Tensor, cache_NSC: torch.Tensor, slot_mapping_T: torch.Tensor,
                              kv_scale: float = 1.0) -> None:
    """Store each token's [latent | k_pe] row at its slot (block_id * S + offset); slot -1 = skip.
    An FP8 cache is quantised with kv_scale (a host float, fixed per layer); others ignore it."""
    if latent_TC.dim() != 2 or cache_NSC.dim() != 3 or latent_TC.shape[1] != cache_NSC.shape[2]:
        raise ValueError(f"latent rows {tuple(latent_TC.shape)} do not fit cache {tuple(cache_NSC.shape)}")
    if slot_mapping_T.shape != (latent_TC.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping_T.shape)} != one slot per token ({latent_TC.shape[0]})")
    if latent_TC.stride(1) != 1 or cache_NSC.stride(2) != 1:
        raise ValueError("latent rows and cache rows must be contiguous in their last dim")
    T, C = latent_TC.shape
    if T == 0:
        return
    quant = is_fp8_kv(cache_NSC.dtype)
    if not quant:
        # torch's cast (round to nearest even), identical to the reference's; the kernel only copies
        latent_TC = latent_TC.to(cache_NSC.dtype)
    _write_latent_kernel[(T,)](latent_TC, cache_NSC, slot_mapping_T, C, latent_TC.stride(0),
                               cache_NSC.stride(0), cache_NSC.stride(1), float(kv_scale), S=cache_NSC.shape[1],
                               BLOCK_C=_pow2(C), QUANT=quant, FP8_MAX=fp8_max(cache_NSC.dtype),
                               INTERPRET=quant_interpreted(cache_NSC.dtype), **pdl_launch(latent_TC))


# The split count is a runtime value and neither it nor the block-table width (an eager step's
# tables are cut to its longest context) is specialised, so an eager step's batch and context
# lengths compile no new variant: only SPLIT (one split or several) does.
@triton.jit(do_not_specialize=["num_splits", "stride_tb"])
def _mla_decode_kernel(
    q_ptr, cache_ptr, tables_ptr, rows_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    H, R, P, qk_scale, num_splits,
    stride_qb, stride_qh, stride_cn, stride_cs, stride_tb, stride_ob, stride_oh, kv_scale,
    S: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    R_PAD: tl.constexpr, P_PAD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
    SCALED: tl.constexpr, ROWS: tl.constexpr,
):
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    head_tile = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, R_PAD)
    offs_p = tl.arange(0, P_PAD)
    h_mask = offs_h < H
    r_mask = offs_r < R
    p_mask = offs_p < P

    # This split's share of the context, in whole BLOCK_N tiles (empty when seq_len is 0).
    seq_len = tl.load(lens_ptr + b)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    q_rows = q_ptr + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(q_rows + R + offs_p[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], dtype=tl.float32)
    if ROWS:  # query rows of a mixed step: each reads the block-table row of its sequence
        table_row = tables_ptr + tl.load(rows_ptr + b).to(tl.int64) * stride_tb
    else:
        table_row = tables_ptr + b.to(tl.int64) * stride_tb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block_id = tl.load(table_row + offs_n // S, mask=n_mask, other=0).to(tl.int64)
        rows = cache_ptr + block_id * stride_cn + (offs_n % S) * stride_cs
        k_lat = tl.load(rows[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        k_pe = tl.load(rows[:, None] + R + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :], other=0.0)
        k_lat = k_lat.to(q_lat.dtype)  # a cache in another dtype than q: compute in q's
        k_pe = k_pe.to(q_lat.dtype)
        s = _dot(q_lat, tl.trans(k_lat), tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32), PRECISION, UPCAST)
        s = _dot(q_pe, tl.trans(k_pe), s, PRECISION, UPCAST) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = _dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # empty split / seq_len 0: acc is 0, so is the output
    acc = acc / l_safe[:, None]
    if SCALED:  # an FP8 cache's scale on the values (the latents); the merge is linear in the parts
        acc = acc * kv_scale
    out_mask = h_mask[:, None] & r_mask[None, :]
    if not SPLIT:
        dst = out_ptr + b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_r[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials: [B, H, NS, R_PAD] fp32 and lse [B, H, NS] (log2 domain)
        bh = b.to(tl.int64) * H + offs_h
        tl.store(part_out_ptr + (bh[:, None] * num_splits + split) * R_PAD + offs_r[None, :], acc, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + bh * num_splits + split, lse, mask=h_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _mla_merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, H, R, stride_ob, stride_oh, num_splits,
                      NS_PAD: tl.constexpr, R_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    bh = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, NS_PAD)
    offs_r = tl.arange(0, R_PAD)
    lse = tl.load(part_lse_ptr + bh * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m > float("-inf"), m, 0.0)  # no split with keys (seq_len 0): all weights 0
    denom = tl.sum(tl.exp2(lse - m), axis=0)
    o = tl.zeros([R_PAD], dtype=tl.float32)
    for s in range(num_splits):  # one [R] row at a time: a [NS, R] tile would not fit registers
        w = tl.exp2(tl.load(part_lse_ptr + bh * num_splits + s) - m)
        o += w * tl.load(part_out_ptr + (bh * num_splits + s) * R_PAD + offs_r)
    o = o / tl.where(denom > 0, denom, 1.0)
    b, h = bh // H, bh % H
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_r, o.to(out_ptr.dtype.element_ty), mask=offs_r < R)


def _decode_tiles(H: int, R_PAD: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps): the [BLOCK_H, R] fp32 accumulator and the [BLOCK_N, C]
    key tile must fit registers / shared memory at R = 512."""
    block_h = min(32, _pow2(H))
    block_n = 32 if R_PAD >= 512 else 64
    return block_h, block_n, 8 if R_PAD >= 256 else 4


def default_num_splits(batch: int, head_tiles: int, max_context: int, device: torch.device) -> int:
    """Enough programs to fill the GPU twice over, but at least ~256 keys per split. Static
    shapes only (the block-table width bounds the context), so a captured graph stays valid."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = triton.cdiv(2 * sms, max(1, batch * head_tiles))
    return max(1, min(want, triton.cdiv(max_context, 256), _MAX_SPLITS))


def mla_token_rows(query_start_loc_B1: torch.Tensor, seq_lens_B: torch.Tensor, num_tokens: int,
                   chunks_apart: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(table_rows_T, lens_T) of a step's num_tokens query tokens for mla_decode_triton: each
    token's sequence and its causal context (the keys up to its own position: seq_lens_B[b] minus
    the sequence's tokens after it). Device ops only, so a CUDA graph captures them; a token of a
    padding sequence (seq_lens 0) gets length 0, and so does a token of a chunk (a sequence of
    several new tokens) with chunks_apart: mla_chunks.py's kernel computes those rows."""
    qsl = query_start_loc_B1
    t = torch.arange(num_tokens, dtype=qsl.dtype, device=qsl.device)
    ends = qsl[1:].contiguous()
    rows = torch.searchsorted(ends, t, right=True).clamp_(max=ends.shape[0] - 1)
    lens = (seq_lens_B.to(qsl.dtype)[rows] - ends[rows] + t + 1).clamp_(min=0)
    if chunks_apart:
        lens = torch.where(ends[rows] - qsl[:-1][rows] > 1, 0, lens)
    return rows, lens


def mla_decode_triton(q_BHC: torch.Tensor, cache_NSC: torch.Tensor, block_tables_BM: torch.Tensor,
                      seq_lens_B: torch.Tensor, scale: float, kv_lora_rank: int,
                      out_BHR: torch.Tensor | None = None, num_splits: int | None = None,
                      kv_scale: float = 1.0, table_rows_B: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed-form MLA decode: one query per row over the first seq_lens_B keys of its
    sequence, read through block_tables_BM. q_BHC = [q_nope @ W_UK | q_pe]; returns out_BHR
    (latent outputs, q's dtype unless `out_BHR` is given). Softmax in fp32. kv_scale: an FP8
    cache's scale (other caches ignore it).

    table_rows_B: each row's block-table row, when rows are not sequences: the query tokens of a
    mixed step, each with the causal length of its position (mla_token_rows); None: row b
    reads table row b."""
    if q_BHC.dim() != 3 or cache_NSC.dim() != 3:
        raise ValueError(f"q must be [B, H, C] and cache [N, S, C]; got {tuple(q_BHC.shape)}, {tuple(cache_NSC.shape)}")
    B, H, C = q_BHC.shape
    R = kv_lora_rank
    if cache_NSC.shape[2] != C or not 0 < R < C:
        raise ValueError(f"q head dim {C}, cache row {cache_NSC.shape[2]} and kv_lora_rank {R} do not match")
    if block_tables_BM.dim() != 2 or seq_lens_B.shape != (B,) or (
            block_tables_BM.shape[0] != B if table_rows_B is None else table_rows_B.shape != (B,)):
        raise ValueError(f"block tables {tuple(block_tables_BM.shape)} / seq_lens {tuple(seq_lens_B.shape)} / "
                         f"table rows {None if table_rows_B is None else tuple(table_rows_B.shape)} "
                         f"do not match {B} rows")
    if any(t is not None and t.dtype not in (torch.int32, torch.int64)
           for t in (block_tables_BM, seq_lens_B, table_rows_B)):
        raise ValueError("block tables, seq_lens and table rows must be int32 or int64")
    if q_BHC.stride(2) != 1 or cache_NSC.stride(2) != 1 or block_tables_BM.stride(1) != 1:
        raise ValueError("q, cache and block tables must be contiguous in their last dim")
    if out_BHR is None:
        out_BHR = q_BHC.new_empty(B, H, R)
    elif out_BHR.shape != (B, H, R) or out_BHR.stride(2) != 1:
        raise ValueError(f"out must be [B, H, R] = {(B, H, R)} with a contiguous last dim, got {tuple(out_BHR.shape)}")
    if B == 0:
        return out_BHR
    R_PAD, P_PAD = _pow2(R), _pow2(C - R)
    block_h, block_n, warps = _decode_tiles(H, R_PAD)
    head_tiles = triton.cdiv(H, block_h)
    S = cache_NSC.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(B, head_tiles, block_tables_BM.shape[1] * S, q_BHC.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_splits > 1:
        part_out = torch.empty(B, H, num_splits, R_PAD, dtype=torch.float32, device=q_BHC.device)
        part_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q_BHC.device)
    else:
        part_out = part_lse = out_BHR  # unused
    upcast = _interpreting() and q_BHC.dtype != torch.float32
    fp8 = is_fp8_kv(cache_NSC.dtype)
    _mla_decode_kernel[(B, head_tiles, num_splits)](
        q_BHC, cache_NSC, block_tables_BM, seq_lens_B if table_rows_B is None else table_rows_B, seq_lens_B,
        out_BHR, part_out, part_lse,
        H, R, C - R, scale * _LOG2E * kv_scale if fp8 else scale * _LOG2E, num_splits,
        q_BHC.stride(0), q_BHC.stride(1), cache_NSC.stride(0), cache_NSC.stride(1), block_tables_BM.stride(0),
        out_BHR.stride(0), out_BHR.stride(1), float(kv_scale),
        S=S, SPLIT=num_splits > 1, SCALED=fp8, ROWS=table_rows_B is not None, BLOCK_H=block_h, BLOCK_N=block_n,
        R_PAD=R_PAD, P_PAD=P_PAD, PRECISION="ieee" if q_BHC.dtype == torch.float32 else "tf32", UPCAST=upcast,
        num_warps=warps, num_stages=2, **pdl_launch(q_BHC))
    if num_splits > 1:
        _mla_merge_kernel[(B * H,)](part_out, part_lse, out_BHR, H, R, out_BHR.stride(0), out_BHR.stride(1),
                                    num_splits, NS_PAD=_MAX_SPLITS, R_PAD=R_PAD,
                                    num_warps=4, **pdl_launch(out_BHR))
    return out_BHR
