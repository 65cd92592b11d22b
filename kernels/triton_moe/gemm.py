"""The two grouped expert GEMMs over aligned row blocks (see align.py), bf16/fp16/fp32, FP8, MXFP4.

Legend: T tokens, D hidden, F expert intermediate, K top-k, R = T*K flat rows, P padded rows.

gate_up:  h_PF[p] = SiLU(x[t] @ gate_e^T) * (x[t] @ up_e^T)   for sorted row p = (t, k) of expert e
  or, SPLIT_K > 1: gu_P2F[p] += x[t] @ [gate_e | up_e]^T over each split's D range (fp32 atomics
          into a zeroed buffer), then gate_up_finish_kernel: h_PF = act(gu_P2F + b13): for steps of a
          few tokens, whose few tiles each loop over all of D and leave the GPU mostly idle
down:     out_RD[r] = w_r * (h_PF[p] @ w2_e^T)                 r = sorted_ids[p], weight in fp32
  or, ATOMIC: out_TD[t] += w_r * (h_PF[p] @ w2_e^T)           r = (t, k), fp32 atomics: the top-k
          sum is fused, and the F range may be split over SPLIT_K programs

Optional (constexpr, so kernels without them compile as before): HAS_BIAS adds the expert's bias in
fp32 to the accumulators in the epilogue (gate_up: b13_e [2F], gate columns then up columns; down:
b2_e [D] before the routed weight, by split 0 alone when SPLIT_K > 1); ACTIVATION "swigluoai"
(gpt-oss) replaces SiLU(g) * u with min(g, limit) * sigmoid(alpha * min(g, limit)) *
(clamp(u, -limit, limit) + 1).

HALF_TILES (constexpr): an expert's last block whose upper half is padding (fewer than BLOCK_M / 2
rows left) runs the same GEMM on a tile of BLOCK_M / 2 rows, so that tall tiles pad no more than
tiles half as tall (the kernels' bodies, _gate_up_rows and _down_rows, take the tile height).

The gate and up tiles of the same output columns are loaded side by side, so the activation is
computed in registers and only h (F wide, not 2F) goes to memory; h is written in the sorted,
padded order, so the down GEMM reads its A operand contiguously. Blocks whose expert is -1 are
skipped by gate_up and written as zeros by down (ATOMIC: skipped, the output starts at zero),
so every flat row is produced exactly once.

FP8 (USE_FP8): weights e4m3 with block scales [E, ceil(N/GN), ceil(Kd/GK)] (dequant = q * s),
activations e4m3 with per-(row, GK-group) scales; BLOCK_K must equal GK. gate_up then quantises
h per (row, GN-group) in its epilogue, which needs BLOCK_N == GN there.

MXFP4 (W_MXFP4): weights only (activations and h stay in their dtype): w uint8 [E, N, Kd/2], two
E2M1 codes a byte, and E8M0 scales ws uint8 [E, N, Kd/32] through the ws_* pointer and strides (the
FP8 scales' arguments). Each K step loads the [BLOCK_N, BLOCK_K/2] bytes and [BLOCK_N, BLOCK_K/32]
scales, dequantises them in registers to the activation dtype (mxfp4.py) and runs the same dot;
BLOCK_K must be a multiple of 32 and Kd of 32, biases and both activations work as above. The
scales (too narrow a load for the pipeliner's async copies) are loaded one step ahead, by hand.
SWAP_AB (constexpr, MXFP4): each step computes acc^T += W_tile @ x_tile^T instead, the accumulator
[BLOCK_N, rows] transposed once before the epilogue: the dequantised weights, made in registers, are
the MMA's A operand (Hopper's wgmma reads A from registers, B only from shared memory, so the plain
order stores every dequantised tile to shared memory first), and a step's few rows its N side.

TMA (constexpr, the down GEMM, 16/32-bit): h_ptr and w_ptr are TMA descriptors (Hopper's tensor memory
accelerator), h over [P, F] with block [BLOCK_M, BLOCK_K] and the weights viewed as [E * D, F] with block
[BLOCK_N, BLOCK_K]: each K step's two tiles are bulk asynchronous copies, not per-thread vector loads (h
is in sorted order, so a block's rows are contiguous). Columns past F read as zeros; a tile past an
expert's last output column reads the next expert's rows, whose columns are never stored.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.pdl import pdl_enter
from kernels.triton_moe.mxfp4 import dot_mxfp4_scaled, load_mxfp4_codes, load_mxfp4_scales, load_mxfp4_t, mxfp4_to


@triton.jit
def _block_coords(num_m_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # GROUP_M M-blocks share their weight columns tile while it is hot in L2
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    gsize = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % gsize
    pid_n = (pid % in_group) // gsize
    return pid_m, pid_n


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the CPU interpreter computes bf16 dots wrongly (triton 3.9); fp32 is exact there
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def half_tile(sorted_ptr, m0, num_valid, BLOCK_M: tl.constexpr, HALF_TILES: tl.constexpr):
    """HALF_TILES: whether the block at sorted row m0 has only padding in its upper half (its
    expert's last block, fewer than BLOCK_M / 2 rows left), so that a tile of BLOCK_M / 2 rows does
    its work: the wide tiles' operand reuse at the padding of tiles half as tall."""
    if HALF_TILES:
        return tl.load(sorted_ptr + m0 + BLOCK_M // 2) >= num_valid
    return False


@triton.jit
def _activate(g, u, swiglu_alpha, swiglu_limit, ACTIVATION: tl.constexpr):
    """h from the fp32 gate and up projections (biases added)."""
    if ACTIVATION == "swigluoai":
        g = tl.minimum(g, swiglu_limit)
        u = tl.minimum(tl.maximum(u, -swiglu_limit), swiglu_limit)
        h = g / (1.0 + tl.exp(-swiglu_alpha * g)) * (u + 1.0)
    else:
        tl.static_assert(ACTIVATION == "silu", "ACTIVATION must be silu or swigluoai")
        h = g / (1.0 + tl.exp(-g)) * u
    return h


@triton.jit
def _gate_up_rows(
    m0, ROWS: tl.constexpr, e, pid_n,
    x_ptr, w_ptr, h_ptr, sorted_ptr, xs_ptr, ws_ptr, hs_ptr, N, Kd, num_valid, top_k,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn,
    stride_xsm, stride_xsk, stride_wse, stride_wsn, stride_wsk, stride_hsm, stride_hsk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GN: tl.constexpr, GK: tl.constexpr,
    USE_FP8: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    b_ptr, stride_be, stride_bn, swiglu_alpha, swiglu_limit,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, W_MXFP4: tl.constexpr, MXFP4_SCALED: tl.constexpr,
    SPLIT_K: tl.constexpr, gu_ptr, stride_gum, SWAP_AB: tl.constexpr,
):
    """h for sorted rows m0 .. m0 + ROWS - 1 (all of expert e) and weight-column tile pid_n (SPLIT_K
    > 1: this program's split of the D range added into gu)."""
    offs_m = m0 + tl.arange(0, ROWS)
    rows = tl.load(sorted_ptr + offs_m)
    rmask = rows < num_valid
    tok = (rows // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_bn = offs_n % N  # in-bounds weight rows; columns >= N are never stored
    offs_k = tl.arange(0, BLOCK_K)
    # SPLIT_K programs (grid axis 1) share this tile, each over its own run of k tiles
    k_tiles = tl.cdiv(Kd, BLOCK_K)
    k_first = 0
    k_last = k_tiles
    if SPLIT_K > 1:
        tl.static_assert(not USE_FP8, "the FP8 gate_up quantises h in its epilogue: no split")
        k_per = tl.cdiv(k_tiles, SPLIT_K)
        k_first = tl.program_id(1) * k_per
        k_last = tl.minimum(k_first + k_per, k_tiles)
    k0 = k_first * BLOCK_K
    a_ptrs = x_ptr + tok[:, None] * stride_xm + (k0 + offs_k)[None, :] * stride_xk
    if W_MXFP4:  # [BLOCK_N, BLOCK_K/2] bytes and [BLOCK_N, BLOCK_K/32] scales a step
        tl.static_assert(not USE_FP8 and BLOCK_K % 32 == 0, "MXFP4 needs BLOCK_K % 32 == 0, no FP8")
        g_ptrs = w_ptr + e * stride_we + offs_bn[:, None] * stride_wn \
            + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :] * stride_wk
        g_sc = ws_ptr + e * stride_wse + offs_bn[:, None] * stride_wsn \
            + (k0 // 32 + tl.arange(0, BLOCK_K // 32))[None, :] * stride_wsk
        u_sc = g_sc + N * stride_wsn
        g_e8 = load_mxfp4_scales(g_sc, tl.minimum(Kd, k_last * BLOCK_K) - k0, BLOCK_K)
        u_e8 = load_mxfp4_scales(u_sc, tl.minimum(Kd, k_last * BLOCK_K) - k0, BLOCK_K)
    else:
        g_ptrs = w_ptr + e * stride_we + offs_bn[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk
    u_ptrs = g_ptrs + N * stride_wn
    if USE_FP8:
        xs_ptrs = xs_ptr + tok * stride_xsm
        gs_ptrs = ws_ptr + e * stride_wse + (offs_bn // GN) * stride_wsn
        us_ptrs = ws_ptr + e * stride_wse + ((offs_bn + N) // GN) * stride_wsn
    if SWAP_AB:  # MXFP4: the transposed product, weights the MMA's A operand (see gemm.py's docstring)
        tl.static_assert(W_MXFP4 and MXFP4_SCALED == "", "SWAP_AB is for MXFP4 tiles dequantised here")
        acc_g = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    else:
        acc_g = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k in range(k_first, k_last):
        if W_MXFP4:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
            else:
                kmask = offs_k < Kd - k * BLOCK_K
                a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            if SWAP_AB:
                g = mxfp4_to(load_mxfp4_codes(g_ptrs, Kd - k * BLOCK_K, BLOCK_K, EVEN_K), g_e8, BLOCK_N, BLOCK_K,
                             a.dtype)
                u = mxfp4_to(load_mxfp4_codes(u_ptrs, Kd - k * BLOCK_K, BLOCK_K, EVEN_K), u_e8, BLOCK_N, BLOCK_K,
                             a.dtype)
            elif MXFP4_SCALED != "":
                g = load_mxfp4_codes(g_ptrs, Kd - k * BLOCK_K, BLOCK_K, EVEN_K)
                u = load_mxfp4_codes(u_ptrs, Kd - k * BLOCK_K, BLOCK_K, EVEN_K)
            else:
                g = load_mxfp4_t(g_ptrs, g_e8, Kd - k * BLOCK_K, BLOCK_N, BLOCK_K, EVEN_K, a.dtype)
                u = load_mxfp4_t(u_ptrs, u_e8, Kd - k * BLOCK_K, BLOCK_N, BLOCK_K, EVEN_K, a.dtype)
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            kmask = offs_k < Kd - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=kmask[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=kmask[:, None], other=0.0)
        if USE_FP8:
            kg = (k * BLOCK_K) // GK
            a_s = tl.load(xs_ptrs + kg * stride_xsk, mask=rmask, other=0.0)
            g_s = tl.load(gs_ptrs + kg * stride_wsk)
            u_s = tl.load(us_ptrs + kg * stride_wsk)
            acc_g += tl.dot(a, g) * a_s[:, None] * g_s[None, :]
            acc_u += tl.dot(a, u) * a_s[:, None] * u_s[None, :]
        elif W_MXFP4 and MXFP4_SCALED != "":
            acc_g = dot_mxfp4_scaled(a, g, g_e8, acc_g, MXFP4_SCALED)
            acc_u = dot_mxfp4_scaled(a, u, u_e8, acc_u, MXFP4_SCALED)
        elif SWAP_AB:
            acc_g = _dot(g, tl.trans(a), acc_g, PRECISION, UPCAST)
            acc_u = _dot(u, tl.trans(a), acc_u, PRECISION, UPCAST)
        else:
            acc_g = _dot(a, g, acc_g, PRECISION, UPCAST)
            acc_u = _dot(a, u, acc_u, PRECISION, UPCAST)
        a_ptrs += BLOCK_K * stride_xk
        if W_MXFP4:
            g_ptrs += (BLOCK_K // 2) * stride_wk
            u_ptrs += (BLOCK_K // 2) * stride_wk
            g_sc += (BLOCK_K // 32) * stride_wsk  # the next step's scales, in flight until it
            u_sc += (BLOCK_K // 32) * stride_wsk
            g_e8 = load_mxfp4_scales(g_sc, tl.minimum(Kd, k_last * BLOCK_K) - (k + 1) * BLOCK_K, BLOCK_K)
            u_e8 = load_mxfp4_scales(u_sc, tl.minimum(Kd, k_last * BLOCK_K) - (k + 1) * BLOCK_K, BLOCK_K)
        else:
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
    if SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    nmask = offs_n < N
    if SPLIT_K > 1:  # partial sums; bias and activation in gate_up_finish_kernel
        gu_ptrs = gu_ptr + offs_m.to(tl.int64)[:, None] * stride_gum + offs_n[None, :]
        mask = rmask[:, None] & nmask[None, :]
        tl.atomic_add(gu_ptrs, acc_g, mask=mask, sem="relaxed")
        tl.atomic_add(gu_ptrs + N, acc_u, mask=mask, sem="relaxed")
    else:
        _gate_up_epilogue(acc_g, acc_u, e, offs_m, offs_n, offs_bn, pid_n, h_ptr, hs_ptr, N, stride_hm, stride_hn,
                          stride_hsm, stride_hsk, b_ptr, stride_be, stride_bn, swiglu_alpha, swiglu_limit,
                          USE_FP8, HAS_BIAS, ACTIVATION)


@triton.jit
def _gate_up_epilogue(acc_g, acc_u, e, offs_m, offs_n, offs_bn, pid_n, h_ptr, hs_ptr, N, stride_hm, stride_hn,
                      stride_hsm, stride_hsk, b_ptr, stride_be, stride_bn, swiglu_alpha, swiglu_limit,
                      USE_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """Bias, activation and the store of h (FP8: quantised per row and GN-group, with its scales)."""
    nmask = offs_n < N
    if HAS_BIAS:
        b_ptrs = b_ptr + e * stride_be + offs_bn * stride_bn
        acc_g += tl.load(b_ptrs).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + N * stride_bn).to(tl.float32)[None, :]
    h = _activate(acc_g, acc_u, swiglu_alpha, swiglu_limit, ACTIVATION)
    h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :] * stride_hn
    if USE_FP8:
        h = tl.where(nmask[None, :], h, 0.0)
        h_s = tl.maximum(tl.max(tl.abs(h), axis=1), 1e-10) / 448.0
        q = tl.clamp(h / h_s[:, None], -448.0, 448.0)
        tl.store(h_ptrs, q.to(h_ptr.dtype.element_ty), mask=nmask[None, :])
        tl.store(hs_ptr + offs_m * stride_hsm + pid_n * stride_hsk, h_s)
    else:
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=nmask[None, :])


# Token counts (num_valid, num_m_blocks) are not specialised: an eager step of any length
# reuses the variant compiled for its config bucket.
@triton.jit(do_not_specialize=["num_valid", "num_m_blocks"])
def gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ptr, expert_ids_ptr, npp_ptr,
    xs_ptr, ws_ptr, hs_ptr,
    N, Kd, num_valid, top_k, num_m_blocks,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn,
    stride_xsm, stride_xsk, stride_wse, stride_wsn, stride_wsk, stride_hsm, stride_hsk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GN: tl.constexpr, GK: tl.constexpr, USE_FP8: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
    b_ptr=None, stride_be=0, stride_bn=0, swiglu_alpha=1.702, swiglu_limit=7.0,
    HAS_BIAS: tl.constexpr = False, ACTIVATION: tl.constexpr = "silu", W_MXFP4: tl.constexpr = False,
    MXFP4_SCALED: tl.constexpr = "", HALF_TILES: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1, gu_ptr=None, stride_gum=0, SWAP_AB: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pid_m, pid_n = _block_coords(num_m_blocks, N, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    if m0 >= tl.load(npp_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    if half_tile(sorted_ptr, m0, num_valid, BLOCK_M, HALF_TILES):
        _gate_up_rows(
            m0, BLOCK_M // 2, e, pid_n,
            x_ptr, w_ptr, h_ptr, sorted_ptr, xs_ptr, ws_ptr, hs_ptr, N, Kd, num_valid, top_k,
            stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn, stride_xsm, stride_xsk,
            stride_wse, stride_wsn, stride_wsk, stride_hsm, stride_hsk, BLOCK_N, BLOCK_K, GN, GK, USE_FP8, EVEN_K,
            PRECISION, UPCAST, b_ptr, stride_be, stride_bn, swiglu_alpha, swiglu_limit, HAS_BIAS, ACTIVATION,
            W_MXFP4, MXFP4_SCALED, SPLIT_K, gu_ptr, stride_gum, SWAP_AB)
    else:
        _gate_up_rows(
            m0, BLOCK_M, e, pid_n,
            x_ptr, w_ptr, h_ptr, sorted_ptr, xs_ptr, ws_ptr, hs_ptr, N, Kd, num_valid, top_k,
            stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn, stride_xsm, stride_xsk,
            stride_wse, stride_wsn, stride_wsk, stride_hsm, stride_hsk, BLOCK_N, BLOCK_K, GN, GK, USE_FP8, EVEN_K,
            PRECISION, UPCAST, b_ptr, stride_be, stride_bn, swiglu_alpha, swiglu_limit, HAS_BIAS, ACTIVATION,
            W_MXFP4, MXFP4_SCALED, SPLIT_K, gu_ptr, stride_gum, SWAP_AB)


@triton.jit
def gate_up_finish_kernel(
    gu_ptr, h_ptr, expert_ids_ptr, npp_ptr, N, stride_gum, stride_hm, stride_hn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
    b_ptr=None, stride_be=0, stride_bn=0, swiglu_alpha=1.702, swiglu_limit=7.0,
    HAS_BIAS: tl.constexpr = False, ACTIVATION: tl.constexpr = "silu",
):
    """h_PF = act(gu_P2F + b13) for the aligned block pid 0 (its expert's bias) and columns pid 1:
    the end of a split gate_up. Blocks of no expert here (-1) and past the padded rows are skipped,
    as gate_up skips them."""
    pdl_enter(USE_PDL)
    pid_m = tl.program_id(0)
    m0 = pid_m * BLOCK_M
    if m0 >= tl.load(npp_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = (offs_n < N)[None, :]
    gu_ptrs = gu_ptr + offs_m[:, None] * stride_gum + offs_n[None, :]
    g = tl.load(gu_ptrs, mask=nmask, other=0.0)
    u = tl.load(gu_ptrs + N, mask=nmask, other=0.0)
    if HAS_BIAS:
        b_ptrs = b_ptr + e * stride_be + offs_n * stride_bn
        g += tl.load(b_ptrs, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        u += tl.load(b_ptrs + N * stride_bn, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    h = _activate(g, u, swiglu_alpha, swiglu_limit, ACTIVATION)
    tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_n[None, :] * stride_hn, h.to(h_ptr.dtype.element_ty),
             mask=nmask)


@triton.jit
def _down_out(out_ptr, m0, pid_n, sorted_ptr, num_valid, N, top_k, stride_om, stride_on,
              ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr):
    """(rows, o_ptrs, o_mask) of the output tile of sorted rows m0 .. m0 + ROWS - 1."""
    rows = tl.load(sorted_ptr + m0 + tl.arange(0, ROWS))
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_mask = (rows < num_valid)[:, None] & (offs_n < N)[None, :]
    if ATOMIC:  # out is the zeroed fp32 [T, N]: row r = (t, k) adds into token t
        o_ptrs = out_ptr + (rows // top_k).to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    else:
        o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    return rows, o_ptrs, o_mask


@triton.jit
def _down_rows(
    m0, ROWS: tl.constexpr, e, pid_n,
    h_ptr, w_ptr, out_ptr, sorted_ptr, topk_w_ptr, hs_ptr, ws_ptr, N, Kd, num_valid, top_k,
    stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    stride_hsm, stride_hsk, stride_wse, stride_wsn, stride_wsk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GN: tl.constexpr, GK: tl.constexpr,
    USE_FP8: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, ATOMIC: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, b_ptr, stride_be, stride_bn, HAS_BIAS: tl.constexpr,
    W_MXFP4: tl.constexpr, MXFP4_SCALED: tl.constexpr, SWAP_AB: tl.constexpr, TMA: tl.constexpr,
):
    """out for sorted rows m0 .. m0 + ROWS - 1 (all of expert e >= 0) and output-column tile pid_n."""
    rows, o_ptrs, o_mask = _down_out(out_ptr, m0, pid_n, sorted_ptr, num_valid, N, top_k, stride_om, stride_on,
                                     ROWS, BLOCK_N, ATOMIC)
    rmask = rows < num_valid
    offs_m = m0 + tl.arange(0, ROWS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # SPLIT_K programs (grid axis 1) share this tile, each over its own run of k tiles
    k_tiles = tl.cdiv(Kd, BLOCK_K)
    k_first = 0
    k_last = k_tiles
    if SPLIT_K > 1:
        k_per = tl.cdiv(k_tiles, SPLIT_K)
        k_first = tl.program_id(1) * k_per
        k_last = tl.minimum(k_first + k_per, k_tiles)
    k0 = k_first * BLOCK_K
    offs_bn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    if TMA:  # the descriptors take tile coordinates: the weight tile's first row in the [E * N, Kd] view
        tl.static_assert(not (USE_FP8 or W_MXFP4), "TMA tiles are 16/32-bit")
        w_row = (e * N + pid_n * BLOCK_N).to(tl.int32)
    else:
        a_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + (k0 + offs_k)[None, :] * stride_hk
    if W_MXFP4:  # [BLOCK_N, BLOCK_K/2] bytes and [BLOCK_N, BLOCK_K/32] scales a step
        tl.static_assert(not USE_FP8 and BLOCK_K % 32 == 0, "MXFP4 needs BLOCK_K % 32 == 0, no FP8")
        b_ptrs = w_ptr + e * stride_we + offs_bn[:, None] * stride_wn \
            + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :] * stride_wk
        b_sc = ws_ptr + e * stride_wse + offs_bn[:, None] * stride_wsn \
            + (k0 // 32 + tl.arange(0, BLOCK_K // 32))[None, :] * stride_wsk
        b_e8 = load_mxfp4_scales(b_sc, tl.minimum(Kd, k_last * BLOCK_K) - k0, BLOCK_K)
    elif not TMA:
        b_ptrs = w_ptr + e * stride_we + offs_bn[None, :] * stride_wn \
            + (k0 + offs_k)[:, None] * stride_wk
    if USE_FP8:
        hs_ptrs = hs_ptr + offs_m * stride_hsm
        bs_ptrs = ws_ptr + e * stride_wse + (offs_bn // GN) * stride_wsn
    if SWAP_AB:
        tl.static_assert(W_MXFP4 and MXFP4_SCALED == "", "SWAP_AB is for MXFP4 tiles dequantised here")
        acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    else:
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k in range(k_first, k_last):
        if TMA:
            a = h_ptr.load([m0, k * BLOCK_K])
            b = w_ptr.load([w_row, k * BLOCK_K]).T
        elif W_MXFP4:
            if EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=(offs_k < Kd - k * BLOCK_K)[None, :], other=0.0)
            if SWAP_AB:
                b = mxfp4_to(load_mxfp4_codes(b_ptrs, Kd - k * BLOCK_K, BLOCK_K, EVEN_K), b_e8, BLOCK_N, BLOCK_K,
                             a.dtype)
            elif MXFP4_SCALED != "":
                b = load_mxfp4_codes(b_ptrs, Kd - k * BLOCK_K, BLOCK_K, EVEN_K)
            else:
                b = load_mxfp4_t(b_ptrs, b_e8, Kd - k * BLOCK_K, BLOCK_N, BLOCK_K, EVEN_K, a.dtype)
        elif EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = offs_k < Kd - k * BLOCK_K
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        if USE_FP8:
            kg = (k * BLOCK_K) // GK
            a_s = tl.load(hs_ptrs + kg * stride_hsk)
            b_s = tl.load(bs_ptrs + kg * stride_wsk)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        elif W_MXFP4 and MXFP4_SCALED != "":
            acc = dot_mxfp4_scaled(a, b, b_e8, acc, MXFP4_SCALED)
        elif SWAP_AB:
            acc = _dot(b, tl.trans(a), acc, PRECISION, UPCAST)
        else:
            acc = _dot(a, b, acc, PRECISION, UPCAST)
        if W_MXFP4:
            a_ptrs += BLOCK_K * stride_hk
            b_ptrs += (BLOCK_K // 2) * stride_wk
            b_sc += (BLOCK_K // 32) * stride_wsk  # the next step's scales, in flight until it
            b_e8 = load_mxfp4_scales(b_sc, tl.minimum(Kd, k_last * BLOCK_K) - (k + 1) * BLOCK_K, BLOCK_K)
        elif not TMA:
            a_ptrs += BLOCK_K * stride_hk
            b_ptrs += BLOCK_K * stride_wk
    if SWAP_AB:
        acc = tl.trans(acc)
    if HAS_BIAS:  # before the routed weight; once per tile, not once per split
        bias = tl.load(b_ptr + e * stride_be + offs_bn * stride_bn).to(tl.float32)
        if SPLIT_K > 1:
            bias = tl.where(tl.program_id(1) == 0, bias, 0.0)
        acc += bias[None, :]
    w = tl.load(topk_w_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    acc = acc * w[:, None]
    if ATOMIC:
        tl.atomic_add(o_ptrs, acc, mask=o_mask, sem="relaxed")
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=["num_valid", "num_m_blocks"])
def down_kernel(
    h_ptr, w_ptr, out_ptr, sorted_ptr, expert_ids_ptr, npp_ptr, topk_w_ptr,
    hs_ptr, ws_ptr,
    N, Kd, num_valid, top_k, num_m_blocks,
    stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    stride_hsm, stride_hsk, stride_wse, stride_wsn, stride_wsk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GN: tl.constexpr, GK: tl.constexpr, USE_FP8: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr, ATOMIC: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
    b_ptr=None, stride_be=0, stride_bn=0, HAS_BIAS: tl.constexpr = False,
    W_MXFP4: tl.constexpr = False, MXFP4_SCALED: tl.constexpr = "", HALF_TILES: tl.constexpr = False,
    SWAP_AB: tl.constexpr = False, TMA: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pid_m, pid_n = _block_coords(num_m_blocks, N, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    if m0 >= tl.load(npp_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if e < 0:  # rows routed to experts on other ranks contribute zero
        if not ATOMIC:
            _, o_ptrs, o_mask = _down_out(out_ptr, m0, pid_n, sorted_ptr, num_valid, N, top_k, stride_om, stride_on,
                                          BLOCK_M, BLOCK_N, ATOMIC)
            tl.store(o_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=o_mask)
        return
    # Without HALF_TILES the branch below is still compiled by Triton before 3.9 (half_tile's False is not a
    # constant there), so it gets the full tile: TMA's descriptors have blocks of BLOCK_M rows only.
    HALF_M: tl.constexpr = BLOCK_M // 2 if HALF_TILES else BLOCK_M
    if half_tile(sorted_ptr, m0, num_valid, BLOCK_M, HALF_TILES):
        _down_rows(
            m0, HALF_M, e, pid_n,
            h_ptr, w_ptr, out_ptr, sorted_ptr, topk_w_ptr, hs_ptr, ws_ptr, N, Kd, num_valid, top_k,
            stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
            stride_hsm, stride_hsk, stride_wse, stride_wsn, stride_wsk, BLOCK_N, BLOCK_K, GN, GK, USE_FP8, EVEN_K,
            SPLIT_K, ATOMIC, PRECISION, UPCAST, b_ptr, stride_be, stride_bn, HAS_BIAS, W_MXFP4, MXFP4_SCALED,
            SWAP_AB, TMA)
    else:
        _down_rows(
            m0, BLOCK_M, e, pid_n,
            h_ptr, w_ptr, out_ptr, sorted_ptr, topk_w_ptr, hs_ptr, ws_ptr, N, Kd, num_valid, top_k,
            stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
            stride_hsm, stride_hsk, stride_wse, stride_wsn, stride_wsk, BLOCK_N, BLOCK_K, GN, GK, USE_FP8, EVEN_K,
            SPLIT_K, ATOMIC, PRECISION, UPCAST, b_ptr, stride_be, stride_bn, HAS_BIAS, W_MXFP4, MXFP4_SCALED,
            SWAP_AB, TMA)

