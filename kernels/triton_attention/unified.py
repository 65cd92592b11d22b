"""Unified paged attention: one launch for a whole mixed batch (prefill chunks, fresh prompts and
decode rows together) in which every K/V tile is read once per KV head and query tile.
Reference: kernels.attention.paged_attention_torch.

Legend: T query tokens (rows of q, at least query_start_loc[B]), B sequences, H query heads,
G KV heads, HG = H // G query heads per KV head, d head dim, N cache blocks, S block size,
BQ query tokens of a tile, M = BQ * HG rows of a tile padded to a power of two (>= 16, tl.dot's
smallest), n_b queries and L_b context tokens of sequence b.

Sequence b owns query rows query_start_loc[b] .. query_start_loc[b+1]-1; query i sits at position
L_b - n_b + i and sees keys key_start(pos) .. pos through the block table (the new tokens' K/V
are in the cache already). A program takes BQ consecutive queries of one sequence times all HG
query heads of one KV head, so the GQA group shares every K/V tile it loads (the varlen prefill
kernel's tile height follows the longest query of the batch instead). Optionally
(decodes_apart) the sequences of one query (decode rows) run in the split-KV decode kernel's
16-row tiles, a second launch, rather than a tile here where one token's HG heads fill 8 of 64 rows.

Grid (T // BQ + B, G), from shapes only, so the launch replays in a CUDA graph for any lengths:
tile slot j of the flat numbering belongs to the last sequence b with
query_start_loc[b] // BQ + b <= j (a binary search over the device offsets). That numbering gives
sequence b at least cdiv(n_b, BQ) slots (one spare at most) without a prefix sum over the batch;
spare slots, and slots past query_start_loc[B] when q has padding rows, return at once and write
nothing. An FP8 cache: as decode.py's docstring says. Sliding windows and sinks: as prefill.py's
docstring says (the decode kernel, with decodes_apart, takes them too).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.attention import check_local, check_sinks, is_fp8_kv
from kernels.pdl import pdl_enter, pdl_launch
from kernels.triton_attention.decode import paged_attention_decode_triton
from kernels.triton_attention.common import (
    LOG2E,
    attend_context,
    check_block_tables,
    check_cache,
    dot_flags,
    head_dim_pad,
)

# Rows (query tokens x query heads) a tile aims at. On an H200 (Qwen3-30B-A3B's 32/4 heads, so 8
# query tokens a tile) 64 rows beat 16 and 32 both beside 256 decodes and beside a 2,048-token
# chunk (BENCHMARKS.md §2). MOE_UNIFIED_ROWS overrides it for A/B runs.
DEFAULT_ROWS = int(os.environ.get("MOE_UNIFIED_ROWS", "64"))
# Sequences of one query (decode rows) go to the split-KV decode kernel's 16-row tiles in a launch
# of their own, the rest here (see unified_attention_triton): in mixed steps replayed from CUDA
# graphs on an H200 the two launches beat one (BENCHMARKS.md §4), though eagerly, where each
# launch costs host time, one was faster (§2). MOE_UNIFIED_DECODES_APART=0: one launch (A/B runs).
DECODES_APART = os.environ.get("MOE_UNIFIED_DECODES_APART", "1") == "1"
# With decodes apart on CUDA, the decode launch on a side stream, beside the prefill rows' launch rather than
# before it: the decode rows read K/V (bandwidth), the chunks' tiles compute, so the two can share the GPU;
# the main stream waits for both (a graph-capturable fork and join). The chunks' kernel is launched first, so
# that its few long programs can take SMs before the decode launch's many short ones fill the rest, rather
# than queue behind them. MOE_UNIFIED_DECODE_STREAM=1 turns it on; off until an engine A/B on the GPU
# (`gpu_run.sh ab`, AB_VAR=MOE_UNIFIED_DECODE_STREAM) shows it faster in this order.
DECODE_STREAM = os.environ.get("MOE_UNIFIED_DECODE_STREAM", "0") == "1"


def parse_tile(text: str | None) -> dict | None:
    """MOE_UNIFIED_TILE="BLOCK_N,num_warps,num_stages" (A/B runs, e.g. 32,4,3): the key tile, warps and
    pipeline stages of this kernel's tiles, in place of the default (64 keys, 4 warps, 2 stages; 32 keys
    above head dim 128). The decode kernel's launch beside it keeps its own. None when unset."""
    if not text:
        return None
    try:
        n, w, s = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"MOE_UNIFIED_TILE must be BLOCK_N,num_warps,num_stages (e.g. 32,4,3), got {text!r}") from None
    if n < 16 or n & (n - 1) or w not in (1, 2, 4, 8) or s < 1:
        raise ValueError(f"MOE_UNIFIED_TILE={text!r}: BLOCK_N must be a power of two >= 16, num_warps 1, 2, 4 or "
                         "8, num_stages >= 1")
    return {"BLOCK_N": n, "num_warps": w, "num_stages": s}


TILE = parse_tile(os.environ.get("MOE_UNIFIED_TILE"))
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def decode_stream_on(q: torch.Tensor, decode_stream: bool | None = None) -> bool:
    """Whether the decode rows' launch goes to the side stream (decode_stream None: DECODE_STREAM)."""
    return q.is_cuda and (DECODE_STREAM if decode_stream is None else decode_stream)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


@triton.jit
def _find_tile(qsl_ptr, B, slot, BQ: tl.constexpr):
    """(b, tile): the sequence of flat tile slot `slot` and the tile's index within it
    (b == B: past the batch)."""
    lo = slot * 0
    hi = lo + B
    # Invariant: f(lo) <= slot, the answer lies in lo .. hi; f(b) = qsl[b] // BQ + b rises strictly.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        f_mid = tl.load(qsl_ptr + mid) // BQ + mid
        fits = f_mid <= slot
        lo = tl.where(fits, mid, lo)
        hi = tl.where(fits, hi, mid - 1)
    return lo, slot - (tl.load(qsl_ptr + lo) // BQ + lo)


# An eager step's sequence count and block-table width compile no new variant.
@triton.jit(do_not_specialize=["B", "stride_btb"])
def _unified_kernel(q_ptr, kv_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, o_ptr, sinks_ptr, B,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_btb, stride_btm,
                    v_offset, stride_blk, stride_tok, scale_log2, chunk_size, window, v_scale,
                    HG: tl.constexpr, BQ: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                    D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, S: tl.constexpr, USE_CHUNK: tl.constexpr,
                    USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
                    SKIP_DECODES: tl.constexpr, SCALE_V: tl.constexpr, INVARIANT: tl.constexpr):
    pdl_enter(USE_PDL)
    # Slots in reverse: a sequence's last tiles see the most keys, so they start first and the
    # grid's tail is short tiles (the order changes nothing else).
    slot = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    b, tile = _find_tile(qsl_ptr, B, slot, BQ)
    if b >= B:
        return
    q_begin = tl.load(qsl_ptr + b)
    n = tl.load(qsl_ptr + b + 1) - q_begin
    m0 = tile * BQ
    if m0 >= n or (SKIP_DECODES and n == 1):
        return
    L = tl.load(seq_lens_ptr + b)

    r = tl.arange(0, BLOCK_M)
    qi = m0 + r // HG
    head = kv_head * HG + r % HG
    row_ok = (r < BQ * HG) & (qi < n)
    qpos = L - n + qi
    dd = tl.arange(0, D_PAD)
    q_off = (q_begin + qi).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + dd[None, :],
                mask=row_ok[:, None] & (dd[None, :] < HEAD_DIM), other=0.0)

    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb
    # head: kv_head * HG + r % HG, a valid head in every row (attend_context's sinks load needs no mask)
    out = attend_context(q, qpos, L - n + m0, BQ, L, chunk_size, window, kv_ptr, bt_row_ptr, stride_btm, kv_head,
                         v_offset, stride_blk, stride_tok, scale_log2, dd, sinks_ptr, head, BLOCK_M, S, BLOCK_N,
                         HEAD_DIM, D_PAD, USE_CHUNK, USE_WINDOW, USE_SINKS, PRECISION, UPCAST, INVARIANT)
    if SCALE_V:  # an FP8 cache's v_scale (k_scale is in scale_log2)
        out = out * v_scale
    o_off = (q_begin + qi).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(o_ptr + o_off[:, None] + dd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dd[None, :] < HEAD_DIM))


def default_block_q(hg: int, rows: int = DEFAULT_ROWS) -> int:
    """Query tokens per tile: as many as fill `rows` rows with all HG heads, at least one."""
    return max(1, rows // hg)


def tile_rows(block_q: int, hg: int) -> int:
    """BLOCK_M: the tile's BQ * HG rows padded to a power of two, at least 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(block_q * hg))


def num_tile_slots(T: int, B: int, block_q: int) -> int:
    """The grid's first dimension: an upper bound on the batch's query tiles from shapes alone."""
    return T // block_q + B


def unified_attention_triton(q_THd: torch.Tensor, kv_cache_2NSGd: torch.Tensor, block_tables_BM: torch.Tensor,
                             query_start_loc_B1: torch.Tensor, seq_lens_B: torch.Tensor, scale: float,
                             chunk_size: int | None = None, out_THd: torch.Tensor | None = None,
                             block_q: int | None = None, config: dict | None = None,
                             decodes_apart: bool | None = None, k_scale: float = 1.0,
                             v_scale: float = 1.0, *, sliding_window: int | None = None,
                             sinks: torch.Tensor | None = None, invariant: bool = False,
                             decode_stream: bool | None = None) -> torch.Tensor:
    """Causal (optionally chunked-local or sliding-window) GQA attention of each sequence's queries
    over its cached context, any mix of prefill and decode rows; returns out_THd [T, H, d] in q's dtype.

    q_THd: [T, H, d] fp32/fp16/bf16, any strides with a unit stride along d. Rows at and past
    query_start_loc[B] (padding) are neither read nor written.
    kv_cache_2NSGd: contiguous [2, N, S, G, d]; K/V are cast to q's dtype on load (an FP8 cache's
    scales: k_scale folded into the score scale, v_scale onto the output; other caches ignore them).
    block_tables_BM: [B, max_blocks] int32/int64. query_start_loc_B1: [B+1], seq_lens_B: [B]
    int32/int64, on the device; only their shapes are read on the host (CUDA-graph safe).
    block_q: query tokens per tile (None: default_block_q). config: optional BLOCK_N / num_warps /
    num_stages (tuning; MOE_UNIFIED_TILE sets this kernel's, not the decode launch's).
    decodes_apart: the sequences of one query run in the split-KV decode kernel (a second
    launch, graph-safe too) instead of a tile here padded to BLOCK_M rows for one token's HG
    heads; None = DECODES_APART. decode_stream: that launch on a side stream, concurrent with this
    kernel's (CUDA only); None = DECODE_STREAM.
    sliding_window: a query at p sees keys max(0, p - sliding_window + 1) .. p (not with chunk_size).
    sinks: fp32 [H] on the device, each head's sink logit (kernels/attention.py); None = none.
    invariant: batch-invariant mode (kernels/batch_invariant.py): a row's result is the same
    whatever else the batch holds and wherever the row sits in its tile (decode rows then share the
    prefill rows' launch whatever decodes_apart says; block_q and config left at their defaults).
    """
    if q_THd.dim() != 3 or q_THd.stride(2) != 1:
        raise ValueError(f"q_THd must be [T, H, d] with unit stride along d, got {tuple(q_THd.shape)}")
    T, H, d = q_THd.shape
    S, G = check_cache(kv_cache_2NSGd, d)
    if H % G:
        raise ValueError(f"query heads {H} must be a multiple of KV heads {G}")
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
    if T == 0 or B == 0:
        return out_THd
    hg = H // G
    if block_q is None:
        block_q = default_block_q(hg)
    if block_q < 1:
        raise ValueError(f"block_q must be >= 1, got {block_q}")
    d_pad = head_dim_pad(d)
    cfg = {"BLOCK_N": 64 if d_pad <= 128 else 32, "num_warps": 4, "num_stages": 2,
           **(TILE if TILE is not None and not invariant else {}), **(config or {})}
    precision, upcast = dot_flags(q_THd.dtype)
    N = kv_cache_2NSGd.shape[1]
    fp8 = is_fp8_kv(kv_cache_2NSGd.dtype)
    if invariant:  # the decode rows' tiles are the prefill rows'
        decodes_apart = False
    elif decodes_apart is None:
        decodes_apart = DECODES_APART

    def decode_rows() -> None:
        paged_attention_decode_triton(q_THd, kv_cache_2NSGd, block_tables_BM, seq_lens_B, scale, chunk_size,
                                      out_BHd=out_THd, query_start_loc_B1=query_start_loc_B1,
                                      block_n=(config or {}).get("BLOCK_N"), k_scale=k_scale, v_scale=v_scale,
                                      sliding_window=sliding_window, sinks=sinks)

    side = None
    if decodes_apart:
        if decode_stream_on(q_THd, decode_stream):
            main = torch.cuda.current_stream(q_THd.device)
            side = _side_stream(q_THd.device)
            side.wait_stream(main)  # the fork; the decode launch follows this kernel's (see DECODE_STREAM)
        else:
            decode_rows()
    grid = (num_tile_slots(T, B, block_q), G)
    _unified_kernel[grid](
        q_THd, kv_cache_2NSGd, block_tables_BM, query_start_loc_B1, seq_lens_B, out_THd,
        seq_lens_B if sinks is None else sinks, B,  # sinks: unused without them
        q_THd.stride(0), q_THd.stride(1), out_THd.stride(0), out_THd.stride(1),
        block_tables_BM.stride(0), block_tables_BM.stride(1),
        N * S * G * d, S * G * d, G * d, scale * LOG2E * k_scale if fp8 else scale * LOG2E, chunk_size or 1,
        sliding_window or 1, float(v_scale), HG=hg, BQ=block_q, BLOCK_M=tile_rows(block_q, hg), HEAD_DIM=d,
        D_PAD=d_pad, BLOCK_N=cfg["BLOCK_N"], S=S, USE_CHUNK=chunk_size is not None,
        USE_WINDOW=sliding_window is not None, USE_SINKS=sinks is not None, PRECISION=precision, UPCAST=upcast,
        SKIP_DECODES=decodes_apart, SCALE_V=fp8, INVARIANT=invariant,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(q_THd))
    if side is not None:
        with torch.cuda.stream(side):
            decode_rows()
        main.wait_stream(side)
    return out_THd
