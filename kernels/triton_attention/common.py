"""Pieces shared by the paged-attention kernels: one online-softmax step over a key tile read
through the block table, input checks and launch constants.

Legend: T query tokens, B sequences, H query heads, G KV heads, d head dim, N cache blocks,
S block size, M rows of a query tile (query x head pairs), BLOCK_N keys of a key tile.
KV cache per layer: kv_cache_2NSGd = [2 (k, v), N, S, G, d], contiguous; the key at position p
of sequence b sits in block block_tables[b, p // S] at offset p % S.
Local attention (chunked-local or a sliding window) and attention sinks: as kernels/attention.py's
docstring says; each is a constexpr switch, so kernels without them compile as before.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LOG2E_JIT = tl.constexpr(LOG2E)  # the same inside kernels
# Running max before any key is seen: finite so that a row whose keys are all masked so far
# gives exp2(-inf - NEG_BIG) = 0 instead of NaN from (-inf) - (-inf).
NEG_BIG = tl.constexpr(-1.0e30)
# attend_context reads each key tile's cache blocks one tile ahead, so that the tile's K/V copies start without
# waiting for a block-table read: on an H100 the varlen prefill kernel took 11-17% less, the unified kernel's
# chunk tiles 3% less (BENCHMARKS.md §2). MOE_ATTN_BLOCK_PREFETCH=0: in the tile's own step (A/B runs).
BLOCK_PREFETCH = tl.constexpr(os.environ.get("MOE_ATTN_BLOCK_PREFETCH", "1") == "1")


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the CPU interpreter computes bf16 dots wrongly (triton 3.9); fp32 is exact there
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def tile_blocks(bt_row_ptr, stride_btm, k0, k_end, S: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """The cache block of each key k0 .. k0+BLOCK_N-1 (int64; with MASKED, 0 for keys >= k_end,
    whose table entries are not read)."""
    kpos = k0 + tl.arange(0, BLOCK_N)
    if MASKED:
        return tl.load(bt_row_ptr + (kpos // S) * stride_btm, mask=kpos < k_end, other=0).to(tl.int64)
    return tl.load(bt_row_ptr + (kpos // S) * stride_btm).to(tl.int64)


@triton.jit
def attend_key_tile(acc, m_i, l_i, q, kv_ptr, bt_row_ptr, stride_btm, kv_head, v_offset,
                    stride_blk, stride_tok, k0, qpos, row_lo, k_end, scale_log2, dd,
                    S: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D_PAD: tl.constexpr, MASKED: tl.constexpr, USE_LO: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One flash-attention step of the query rows `q` [M, D_PAD] over keys k0 .. k0+BLOCK_N-1.

    MASKED: keys >= k_end are not read, and row r sees key j only if j <= qpos[r] (and, with
    USE_LO, j >= row_lo[r]: the chunked-local window). Without MASKED every key is valid for
    every row (the caller guarantees it), so no mask is built.
    Scores are in log2 units (scale_log2 = scale * log2(e)), the state is fp32.
    """
    blk = tile_blocks(bt_row_ptr, stride_btm, k0, k_end, S, BLOCK_N, MASKED)
    return attend_blocks(acc, m_i, l_i, q, kv_ptr, blk, kv_head, v_offset, stride_blk, stride_tok, k0, qpos, row_lo,
                         k_end, scale_log2, dd, S, BLOCK_N, HEAD_DIM, D_PAD, MASKED, USE_LO, PRECISION, UPCAST)


@triton.jit
def attend_blocks(acc, m_i, l_i, q, kv_ptr, blk, kv_head, v_offset, stride_blk, stride_tok, k0, qpos, row_lo, k_end,
                  scale_log2, dd, S: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  D_PAD: tl.constexpr, MASKED: tl.constexpr, USE_LO: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """attend_key_tile with the key tile's cache blocks `blk` (tile_blocks) given."""
    kpos = k0 + tl.arange(0, BLOCK_N)
    if MASKED:
        k_ok = kpos < k_end
    # Each key row is d contiguous elements of one cache slot.
    row_off = blk * stride_blk + (kpos % S).to(tl.int64) * stride_tok + kv_head * HEAD_DIM
    ptrs = kv_ptr + row_off[:, None] + dd[None, :]
    if MASKED:
        ld_mask = k_ok[:, None] & (dd[None, :] < HEAD_DIM)
        k = tl.load(ptrs, mask=ld_mask, other=0.0)
        v = tl.load(ptrs + v_offset, mask=ld_mask, other=0.0)
    elif D_PAD != HEAD_DIM:
        ld_mask = dd[None, :] < HEAD_DIM
        k = tl.load(ptrs, mask=ld_mask, other=0.0)
        v = tl.load(ptrs + v_offset, mask=ld_mask, other=0.0)
    else:
        k = tl.load(ptrs)
        v = tl.load(ptrs + v_offset)
    k = k.to(q.dtype)
    v = v.to(q.dtype)

    qk = _dot(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], dtype=tl.float32), PRECISION, UPCAST)
    qk = qk * scale_log2
    if MASKED:
        allowed = (kpos[None, :] <= qpos[:, None]) & k_ok[None, :]
        if USE_LO:
            allowed = allowed & (kpos[None, :] >= row_lo[:, None])
        qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
    return acc, m_new, l_i


@triton.jit
def join_sink(acc, m_i, l_i, sink_log2):
    """The online-softmax state after one more key of score sink_log2 [M] (log2 units) and value
    zero: it only adds to the denominator (-inf: no sink)."""
    m_new = tl.maximum(m_i, sink_log2)
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None], m_new, l_i * alpha + tl.exp2(sink_log2 - m_new)


@triton.jit
def attend_context(q, qpos, q_first, num_queries, L, chunk_size, window, kv_ptr, bt_row_ptr, stride_btm, kv_head,
                   v_offset, stride_blk, stride_tok, scale_log2, dd, sinks_ptr, head, BLOCK_M: tl.constexpr,
                   S: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                   USE_CHUNK: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, INVARIANT: tl.constexpr):
    """Causal (optionally chunked-local or sliding-window) attention of a tile's rows q
    [BLOCK_M, D_PAD] at positions qpos (the tile's queries q_first .. q_first + num_queries - 1)
    over the keys 0 .. L - 1 of one sequence through its block-table row; returns the normalised
    fp32 output. A row that sees no key (a padding sequence has L = 0, its rows negative
    positions) gets zeros: no key tile below 0 or past L - 1 is read.
    USE_WINDOW: row r sees keys max(0, qpos[r] - window + 1) .. qpos[r]. USE_SINKS: row r's softmax
    has head[r]'s sink logit (sinks_ptr, natural-log units) as one more column of value zero;
    head[r] must be a valid head for every row, padding rows included.
    INVARIANT (batch-invariant mode): key tiles on the grid of BLOCK_N from key 0 and every tile
    masked, so a row's arithmetic does not depend on the tile's other rows (which tiles the
    unmasked fast path would take does); a tile a row cannot see adds exactly nothing to it."""
    q_last = tl.minimum(q_first + num_queries - 1, L - 1)
    if USE_CHUNK:
        row_lo = (qpos // chunk_size) * chunk_size
        k_lo = tl.maximum((q_first // chunk_size) * chunk_size, 0)  # keys before the first row's chunk: never read
        same_chunk = k_lo == (q_last // chunk_size) * chunk_size
    elif USE_WINDOW:
        row_lo = tl.maximum(qpos - window + 1, 0)
        k_lo = tl.maximum(q_first - window + 1, 0)  # keys before the first row's window: never read
        same_chunk = True
    else:
        row_lo = qpos * 0
        k_lo = q_first * 0
        same_chunk = True
    if USE_WINDOW:
        # The rows' windows start at different keys: keys from the last row's start to q_first are
        # visible to every row, so whole tiles of them (on the grid of tiles from k_lo) run without
        # masks; those before (some rows' windows only) and after (the causal diagonal, the context's
        # end) masked.
        k_all = tl.maximum(q_last - window + 1, 0)
        k_mask_end = tl.minimum(k_lo + tl.cdiv(k_all - k_lo, BLOCK_N) * BLOCK_N, q_last + 1)
    else:
        k_mask_end = k_lo
    # Keys k_mask_end .. q_first are visible to every row when all rows share one chunk: whole
    # tiles of them run without masks, the rest (causal diagonal, chunk edges, the context's end) masked.
    if same_chunk:
        k_free = tl.maximum(k_mask_end + ((q_first + 1 - k_mask_end) // BLOCK_N) * BLOCK_N, k_mask_end)
    else:
        k_free = k_lo
    if INVARIANT:
        k_lo = (k_lo // BLOCK_N) * BLOCK_N
        k_mask_end = k_lo
        k_free = k_lo
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_WINDOW:
        for k0 in range(k_lo, k_mask_end, BLOCK_N):
            acc, m_i, l_i = attend_key_tile(acc, m_i, l_i, q, kv_ptr, bt_row_ptr, stride_btm, kv_head, v_offset,
                                            stride_blk, stride_tok, k0, qpos, row_lo, L, scale_log2, dd,
                                            S, BLOCK_N, HEAD_DIM, D_PAD, True, True, PRECISION, UPCAST)
    if BLOCK_PREFETCH:
        # The next key tile's cache blocks are read while this tile computes (see BLOCK_PREFETCH).
        blk = tile_blocks(bt_row_ptr, stride_btm, k_mask_end, L, S, BLOCK_N, True)
        for k0 in range(k_mask_end, k_free, BLOCK_N):
            blk_next = tile_blocks(bt_row_ptr, stride_btm, k0 + BLOCK_N, L, S, BLOCK_N, True)
            acc, m_i, l_i = attend_blocks(acc, m_i, l_i, q, kv_ptr, blk, kv_head, v_offset, stride_blk, stride_tok,
                                          k0, qpos, row_lo, L, scale_log2, dd, S, BLOCK_N, HEAD_DIM, D_PAD, False,
                                          USE_CHUNK or USE_WINDOW, PRECISION, UPCAST)
            blk = blk_next
        for k0 in range(k_free, q_last + 1, BLOCK_N):
            blk_next = tile_blocks(bt_row_ptr, stride_btm, k0 + BLOCK_N, L, S, BLOCK_N, True)
            acc, m_i, l_i = attend_blocks(acc, m_i, l_i, q, kv_ptr, blk, kv_head, v_offset, stride_blk, stride_tok,
                                          k0, qpos, row_lo, L, scale_log2, dd, S, BLOCK_N, HEAD_DIM, D_PAD, True,
                                          USE_CHUNK or USE_WINDOW, PRECISION, UPCAST)
            blk = blk_next
    else:
        for k0 in range(k_mask_end, k_free, BLOCK_N):
            acc, m_i, l_i = attend_key_tile(acc, m_i, l_i, q, kv_ptr, bt_row_ptr, stride_btm, kv_head, v_offset,
                                            stride_blk, stride_tok, k0, qpos, row_lo, L, scale_log2, dd,
                                            S, BLOCK_N, HEAD_DIM, D_PAD, False, USE_CHUNK or USE_WINDOW, PRECISION,
                                            UPCAST)
        for k0 in range(k_free, q_last + 1, BLOCK_N):
            acc, m_i, l_i = attend_key_tile(acc, m_i, l_i, q, kv_ptr, bt_row_ptr, stride_btm, kv_head, v_offset,
                                            stride_blk, stride_tok, k0, qpos, row_lo, L, scale_log2, dd,
                                            S, BLOCK_N, HEAD_DIM, D_PAD, True, USE_CHUNK or USE_WINDOW, PRECISION,
                                            UPCAST)
    if USE_SINKS:
        acc, m_i, l_i = join_sink(acc, m_i, l_i, tl.load(sinks_ptr + head).to(tl.float32) * LOG2E_JIT)
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


def dot_flags(dtype: torch.dtype) -> tuple[str, bool]:
    """(input_precision, upcast): exact fp32 dots for fp32 inputs; fp32 dots under the interpreter
    for half types (its bf16 dot is wrong)."""
    precision = "ieee" if dtype == torch.float32 else "tf32"
    upcast = dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1"
    return precision, upcast


def head_dim_pad(d: int) -> int:
    """Head dim rounded up to a power of two, at least 16 (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(d))


def check_cache(kv_cache_2NSGd: torch.Tensor, d: int, name: str = "kv_cache_2NSGd") -> tuple[int, int]:
    """Validates the cache layout; returns (S, G)."""
    if kv_cache_2NSGd.dim() != 5 or kv_cache_2NSGd.shape[0] != 2:
        raise ValueError(f"{name} must be [2, N, S, G, d], got {tuple(kv_cache_2NSGd.shape)}")
    if not kv_cache_2NSGd.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if kv_cache_2NSGd.shape[4] != d:
        raise ValueError(f"{name} head dim {kv_cache_2NSGd.shape[4]} != query head dim {d}")
    return kv_cache_2NSGd.shape[2], kv_cache_2NSGd.shape[3]


def check_block_tables(block_tables_BM: torch.Tensor, B: int) -> None:
    if block_tables_BM.dim() != 2 or block_tables_BM.shape[0] != B:
        raise ValueError(f"block_tables_BM must be [B={B}, max_blocks], got {tuple(block_tables_BM.shape)}")
    if block_tables_BM.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables_BM must be int32 or int64, got {block_tables_BM.dtype}")


def heads_per_program(H: int, G: int, cap: int) -> int:
    """Query heads of one KV group served together: the largest divisor of H // G <= cap."""
    if H % G:
        raise ValueError(f"query heads {H} must be a multiple of KV heads {G}")
    hg = H // G
    return max(h for h in range(1, min(hg, cap) + 1) if hg % h == 0)
