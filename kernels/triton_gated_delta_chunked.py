"""The gated delta rule in chunks on the GPU: prefill of Qwen3-Next's linear-attention layers as
matrix products (the tensor cores), where kernels/triton_gated_delta.py walks the tokens one by one.
Same arguments, results and contract as gated_delta_rule_recurrent_triton there (the flat varlen
batch, state slots read and written in place on the device, rows past the batch zeroed), and as it
CUDA-graph capturable: the grid and every launch argument come from shapes only.

The recurrent kernel takes the sequences of fewer than `recurrent_below` tokens (decodes: one
state read and write, what it is built for); the others go CHUNK tokens at a time (positions i, j
of a chunk; G the cumulative log decay from its start; Gam_ij = exp(G_i - G_j) for j <= i, else 0;
q, k L2-normalised in fp32, q scaled), in two phases, each launch skipping the other's sequences on
the device:

1. Every chunk at once (program: chunk p of the batch, found by a cumulative count of the
   sequences' chunks, x value head): what does not depend on the state,
       A    = strict_tril(beta K K^T * Gam)            (CHUNK x CHUNK)
       Tinv = (I + A)^-1, by forward substitution a row at a time, in fp32 (the power series
              (I - A)(I + A^2)(I + A^4)... is exact in theory, but with aligned keys its powers
              grow as binomials and cancel: fp32 loses everything; substitution stays stable)
       W = Tinv (beta exp(G) K),   U = Tinv (beta V)
   into fp32 scratch rows (a token's W and U: [T, Hv, Dk] and [T, Hv, Dv], allocated per call).
2. Each sequence's chunks in turn (program: sequence, value head, value block, its state slice
   S [Dk, BLOCK_V] in registers): four products a chunk,
       Delta = U - W S,   O = exp(G) Q S + (Q K^T * Gam) Delta,
       S = exp(G_last) S + (exp(G_last - G) K)^T Delta.

(kernels/gated_delta.py's _chunked derives it.) Rows past a sequence's end load as zeros
(k = beta = g = 0 write and decay nothing), so a partial last chunk needs no other care; every
exponent is <= 0. The scratch and the grids come from shapes (phase 1: T / CHUNK chunks plus a
partial one per long sequence at most).

The products run at `precision` (tl.dot's input_precision): "ieee" (fp32 FMAs), "tf32x3" (three
TF32 tensor-core products, fp32-level error), "tf32".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch
from kernels.triton_gated_delta import DEFAULT_BLOCK_V as RECURRENT_BLOCK_V
from kernels.triton_gated_delta import (_batch_args, check_delta_args, launch_recurrent, load_state_slice,
                                        store_state_slice)

DEFAULT_CHUNK = 32
DEFAULT_BLOCK_V = 64
# a sequence shorter than this is walked token by token, where the recurrent kernel is the faster
# (four 64-token prompts: 123 vs 291 µs, eagerly on an H100; BENCHMARKS.md §4, Qwen3-Next)
DEFAULT_RECURRENT_BELOW = 128
PRECISIONS = ("ieee", "tf32x3", "tf32")


@triton.jit
def _load_rows(ptr, rows, ok, stride_t, head_off, cols, COLS: tl.constexpr):
    """[len(rows), len(cols)] fp32 from rows (zeros where not ok or past COLS)."""
    return tl.load(ptr + rows[:, None] * stride_t + head_off + cols[None, :],
                   mask=ok[:, None] & (cols < COLS)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _chunk_solve(k, v, g, beta, i, j, idx, PRECISION: tl.constexpr):
    """A chunk's (W, U, G): W = Tinv (beta exp(G) K), U = Tinv (beta V), Tinv = (I + A)^-1 by
    forward substitution (module docstring), from its normalised keys k [CHUNK, DK_PAD], values v,
    log decays g and write strengths beta (zeros past the sequence)."""
    G = tl.cumsum(g, 0)
    gam = tl.exp(tl.where(i >= j, G[:, None] - G[None, :], float("-inf")))
    A = tl.where(i > j, beta[:, None] * tl.dot(k, tl.trans(k), input_precision=PRECISION) * gam, 0.0)
    # row r = e_r - sum_{j<r} A_rj row_j; the rows below r are still identity rows, which A_rj = 0
    # (j >= r) leaves out
    tinv = tl.where(i == j, 1.0, 0.0)
    for r in range(1, k.shape[0]):
        a_r = tl.sum(tl.where(i == r, A, 0.0), 0)  # A's row r, along j
        row = tl.where(idx == r, 1.0, 0.0) - tl.sum(a_r[:, None] * tinv, 0)
        tinv = tl.where(i == r, row[None, :], tinv)
    w = tl.dot(tinv, (beta * tl.exp(G))[:, None] * k, input_precision=PRECISION)
    u = tl.dot(tinv, beta[:, None] * v, input_precision=PRECISION)
    return w, u, G


@triton.jit(do_not_specialize=["long_from"])
def _chunk_prepare_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, qsl_ptr, w_ptr, u_ptr, B, long_from,
                          stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
                          stride_wt, stride_wh, stride_ut, stride_uh, GROUP: tl.constexpr, DK: tl.constexpr,
                          DV: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, B_PAD: tl.constexpr,
                          L2NORM: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """Phase 1, every chunk at once: program (p, value head h) finds the p-th chunk of the batch's
    long sequences (a cumulative count over the sequences, on the device) and writes its W and U
    rows to the scratch tensors w [T, Hv, Dk], u [T, Hv, Dv] (fp32)."""
    pdl_enter(USE_PDL)
    p = tl.program_id(0)
    h = tl.program_id(1)
    seqs = tl.arange(0, B_PAD)
    s_ok = seqs < B
    starts = tl.load(qsl_ptr + seqs, mask=s_ok, other=0).to(tl.int64)
    ends = tl.load(qsl_ptr + seqs + 1, mask=s_ok, other=0).to(tl.int64)
    n = tl.where(s_ok & (ends - starts >= long_from), (ends - starts + CHUNK - 1) // CHUNK, 0)
    after = tl.cumsum(n, 0)  # chunks up to and including each sequence
    hit = (after - n <= p) & (p < after)  # the sequence holding chunk p (none past the last chunk)
    if tl.sum(hit.to(tl.int32), 0) == 0:
        return
    t0 = tl.sum(tl.where(hit, starts + (p - (after - n)) * CHUNK, 0), 0)
    end = tl.sum(tl.where(hit, ends, 0), 0)
    idx = tl.arange(0, CHUNK)
    rows = t0 + idx
    ok = rows < end
    dk = tl.arange(0, DK_PAD)
    dv = tl.arange(0, DV_PAD)
    k = _load_rows(k_ptr, rows, ok, stride_kt, (h // GROUP) * stride_kh, dk, DK)
    v = _load_rows(v_ptr, rows, ok, stride_vt, h * stride_vh, dv, DV)
    g = tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * stride_bt + h * stride_bh, mask=ok, other=0.0).to(tl.float32)
    if L2NORM:
        k = k * tl.math.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
    w, u, _ = _chunk_solve(k, v, g, beta, idx[:, None], idx[None, :], idx, PRECISION)
    tl.store(w_ptr + rows[:, None] * stride_wt + h * stride_wh + dk[None, :], w, mask=ok[:, None] & (dk < DK)[None, :])
    tl.store(u_ptr + rows[:, None] * stride_ut + h * stride_uh + dv[None, :], u, mask=ok[:, None] & (dv < DV)[None, :])


@triton.jit(do_not_specialize=["long_from"])
def _chunk_scan_kernel(q_ptr, k_ptr, g_ptr, qsl_ptr, state_ptr, slots_ptr, init_ptr, w_ptr, u_ptr, o_ptr,
                       long_from, scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh,
                       stride_wt, stride_wh, stride_ut, stride_uh, stride_ot, stride_oh, stride_sn, stride_sh,
                       GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr,
                       BLOCK_V: tl.constexpr, L2NORM: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """Phase 2, each long sequence's chunks in turn: program (b, value head h, value block) carries
    its state slice through Delta = U - W S, O = exp(G) Q S + (Q K^T * Gam) Delta and
    S = exp(G_last) S + (exp(G_last - G) K)^T Delta, reading phase 1's W and U."""
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(qsl_ptr + b).to(tl.int64)
    end = tl.load(qsl_ptr + b + 1).to(tl.int64)
    if end - start < long_from:  # the recurrent kernel's
        return
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    dv_ok = dv < DV
    kh = h // GROUP
    dk = tl.arange(0, DK_PAD)
    state, s_ptrs, live = load_state_slice(state_ptr, slots_ptr, init_ptr, b, h, dk, dv, dv_ok, stride_sn, stride_sh,
                                           DK, DV)
    idx = tl.arange(0, CHUNK)
    i = idx[:, None]
    j = idx[None, :]
    for t0 in range(start, end, CHUNK):
        rows = t0 + idx
        ok = rows < end
        q = _load_rows(q_ptr, rows, ok, stride_qt, kh * stride_qh, dk, DK)
        k = _load_rows(k_ptr, rows, ok, stride_kt, kh * stride_kh, dk, DK)
        g = tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=ok, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.math.rsqrt(tl.sum(q * q, 1) + 1e-6)[:, None]
            k = k * tl.math.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        q = q * scale
        G = tl.cumsum(g, 0)
        gam = tl.exp(tl.where(i >= j, G[:, None] - G[None, :], float("-inf")))
        w = tl.load(w_ptr + rows[:, None] * stride_wt + h * stride_wh + dk[None, :],
                    mask=ok[:, None] & (dk < DK)[None, :], other=0.0)
        u = tl.load(u_ptr + rows[:, None] * stride_ut + h * stride_uh + dv[None, :],
                    mask=ok[:, None] & dv_ok[None, :], other=0.0)
        delta = u - tl.dot(w, state, input_precision=PRECISION)  # [CHUNK, BLOCK_V]
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * gam  # gam is 0 above the diagonal
        o = tl.dot(q * tl.exp(G)[:, None], state, input_precision=PRECISION) \
            + tl.dot(qk, delta, input_precision=PRECISION)
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + dv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=ok[:, None] & dv_ok[None, :])
        g_last = tl.sum(tl.where(idx == CHUNK - 1, G, 0.0), 0)  # padded rows add no decay
        state = state * tl.exp(g_last) \
            + tl.dot(tl.trans(k * tl.exp(g_last - G)[:, None]), delta, input_precision=PRECISION)
    store_state_slice(s_ptrs, state, live, dk, dv_ok, DK)


def gated_delta_rule_chunked_triton(q_TKd: torch.Tensor, k_TKd: torch.Tensor, v_TVe: torch.Tensor,
                                    g_TV: torch.Tensor, beta_TV: torch.Tensor, query_start_loc,
                                    ssm_state_NVde: torch.Tensor, slots_B: torch.Tensor, has_initial_B: torch.Tensor,
                                    scale: float | None = None, use_qk_l2norm: bool = True,
                                    chunk_size: int = DEFAULT_CHUNK, *, block_v: int = DEFAULT_BLOCK_V,
                                    recurrent_below: int = DEFAULT_RECURRENT_BELOW, precision: str | None = None,
                                    num_warps: int | None = None) -> torch.Tensor:
    """The gated delta rule of each sequence from its state (module docstring; arguments and results
    as kernels.triton_gated_delta.gated_delta_rule_recurrent_triton). chunk_size: tokens a chunk (a
    power of two, 16 .. 128); block_v: value columns a program of the chunked kernel (a power of
    two, at least 16); recurrent_below: sequences shorter than this go to the recurrent kernel;
    precision: the products' input_precision (see the module docstring); None: "tf32x3" for fp32
    inputs (fp32-level results), "tf32" for bf16 / fp16 ones (errors at their own precision's level);
    num_warps: both phases' (None: 4, or 8 when a chunk's tiles pass 4096 values)."""
    check_delta_args(q_TKd, k_TKd, v_TVe, g_TV, beta_TV, ssm_state_NVde)
    if chunk_size not in (16, 32, 64, 128):
        raise ValueError(f"chunk_size must be 16, 32, 64 or 128, got {chunk_size}")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two of at least 16, got {block_v}")
    if recurrent_below < 1:
        raise ValueError(f"recurrent_below must be positive, got {recurrent_below}")
    if precision is None:
        precision = "tf32x3" if q_TKd.dtype == torch.float32 else "tf32"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    T, Hk, Dk = q_TKd.shape
    Hv, Dv = v_TVe.shape[1:]
    B, qsl, slots, init = _batch_args(T, query_start_loc, slots_B, has_initial_B, q_TKd.device)
    o_TVe = torch.empty(T, Hv, Dv, dtype=q_TKd.dtype, device=q_TKd.device)
    # short sequences, and the rows past the batch (zeros)
    launch_recurrent(q_TKd, k_TKd, v_TVe, g_TV, beta_TV, qsl, ssm_state_NVde, slots, init, o_TVe, scale,
                     use_qk_l2norm, RECURRENT_BLOCK_V, None, long_from=recurrent_below)
    if Hv == 0 or B == 0:
        return o_TVe
    dk_pad = max(16, triton.next_power_of_2(Dk))
    block_v = min(block_v, max(16, triton.next_power_of_2(Dv)))
    if num_warps is None:
        num_warps = 4 if chunk_size * max(dk_pad, block_v) <= 4096 else 8
    scale = float(Dk ** -0.5 if scale is None else scale)
    common = dict(GROUP=Hv // Hk, DK=Dk, DV=Dv, DK_PAD=dk_pad, L2NORM=bool(use_qk_l2norm), CHUNK=chunk_size,
                  PRECISION=precision, **pdl_launch(q_TKd))
    w = torch.empty(T, Hv, Dk, dtype=torch.float32, device=q_TKd.device)
    u = torch.empty(T, Hv, Dv, dtype=torch.float32, device=q_TKd.device)
    # at most T / chunk_size chunks, plus a partial one for each long sequence
    max_chunks = triton.cdiv(T, chunk_size) + min(B, T // recurrent_below)
    _chunk_prepare_kernel[(max_chunks, Hv)](
        k_TKd, v_TVe, g_TV, beta_TV, qsl, w, u, B, recurrent_below,
        k_TKd.stride(0), k_TKd.stride(1), v_TVe.stride(0), v_TVe.stride(1), g_TV.stride(0), g_TV.stride(1),
        beta_TV.stride(0), beta_TV.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        DV_PAD=max(16, triton.next_power_of_2(Dv)), B_PAD=max(16, triton.next_power_of_2(B)),
        num_warps=num_warps, **common)
    _chunk_scan_kernel[(B, Hv, triton.cdiv(Dv, block_v))](
        q_TKd, k_TKd, g_TV, qsl, ssm_state_NVde, slots, init, w, u, o_TVe, recurrent_below, scale,
        q_TKd.stride(0), q_TKd.stride(1), k_TKd.stride(0), k_TKd.stride(1), g_TV.stride(0), g_TV.stride(1),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1), o_TVe.stride(0), o_TVe.stride(1),
        ssm_state_NVde.stride(0), ssm_state_NVde.stride(1), BLOCK_V=block_v, num_warps=num_warps, **common)
    return o_TVe
