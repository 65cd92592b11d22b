"""Gated DeltaNet on the GPU: the depthwise causal conv and the recurrent gated delta rule of
Qwen3-Next's linear-attention layers over a flat varlen batch, each sequence continuing from its
slot of the layer's state pools. Same arguments and results as the torch reference
kernels/gated_delta.py (causal_conv1d_varlen, gated_delta_rule_varlen), CUDA-graph capturable.

Legend: T tokens, B sequences, N pool slots. Conv: C channels, K taps, S = K - 1 state columns,
BLOCK_T tokens x BLOCK_C channels a tile. Delta rule: Hk key heads (q, k) of dim Dk, Hv value heads
of dim Dv (value head h reads key head h // (Hv // Hk)), BLOCK_V value columns a program.

Sequence b owns rows query_start_loc[b] .. query_start_loc[b + 1] - 1; query_start_loc, slots_B and
has_initial_B are read on the device, so the grid and every launch argument come from shapes only
and a captured graph replays for any batch layout of the same shapes. Rows past
query_start_loc[B] (a padded graph's spare rows) come out as zeros: one more program row of the
grid (sequence index B) writes them. has_initial_B[b] False: the prior state reads as zeros
(masked loads: the slot is not read, NaN there is harmless). Every sequence's new state is written
back to its slot in place, also for zero-token sequences (their prior state, or zeros); other
slots are not touched. Slots must be distinct; a negative one (a CUDA graph's padding sequence) reads
zeros and is written nowhere.

Conv (causal_conv1d_varlen_triton): program (b, channel block) walks b's tokens a tile of BLOCK_T
at a time; tap j of row r reads the input at position r - S + j, from x or, before the sequence's
first token, from the history conv_state[slot][:, S + position] (zeros without has_initial). The
K loads of a tile are independent, so a prefill chunk is not a chain of one-token latencies; at
BLOCK_T = 1 (decode) this is exactly the history in registers plus one new column. BLOCK_T is
chosen from T / B (a shape). Then the new state (the last S inputs of history ++ tokens) is read,
the program's threads synchronise (its reads of the old history happen before any write), and it
is stored.

Delta rule (gated_delta_rule_recurrent_triton): program (b, value head h, value block) keeps its
slice S[:, block] (Dk x BLOCK_V, fp32) of the state in registers and walks b's tokens one by one:
S *= exp(g_t); delta = beta_t (v_t - S^T k_t); S += k_t delta^T; o_t = S^T q_t, with q_t and k_t
L2-normalised in fp32 inside the program (every program of a key head recomputes it: Dk values)
and q_t scaled. The next token's inputs are loaded before the current one is computed, so in a
prefill chunk their latency overlaps the arithmetic. A decode step (one token a sequence) reads
and writes the state once: memory-bound on those 2 * Hv * Dk * Dv * 4 bytes a sequence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch

MAX_HEAD_DIM = 256  # Dk and Dv: the state slice and q / k of a program live in registers
MAX_TAPS = 16  # K: the taps are unrolled
CONV_BLOCK_C = 128
CONV_MAX_BLOCK_T = 16
CONV_TILE = 1024  # tokens x channels of a conv tile at most: at 16 x 64, 154 registers on sm_90 (16 x 128: 254)
DEFAULT_BLOCK_V = 32  # with Dk = 128: 4096 state values, 32 fp32 registers a thread at 4 warps


# --- the causal conv ------------------------------------------------------------------------------

@triton.jit
def _zero_spare_rows(y_ptr, qsl_ptr, B, T, stride_yt, cols, col_ok, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Zeros in rows query_start_loc[B] .. T - 1 of y at the columns `cols` (a padded graph's spare rows)."""
    first = tl.load(qsl_ptr + B).to(tl.int64)
    rows = tl.arange(0, BLOCK_T)
    zeros = tl.zeros([BLOCK_T, BLOCK_C], dtype=y_ptr.dtype.element_ty)
    for t0 in range(first, T, BLOCK_T):
        t = t0 + rows
        tl.store(y_ptr + t[:, None] * stride_yt + cols[None, :], zeros, mask=(t < T)[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _causal_conv1d_kernel(x_ptr, w_ptr, bias_ptr, qsl_ptr, state_ptr, slots_ptr, init_ptr, y_ptr, T, C,
                          stride_xt, stride_yt, stride_wc, stride_wk, stride_sn, stride_sc, stride_ss,
                          K: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                          USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    B = tl.num_programs(0) - 1
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    if b == B:
        _zero_spare_rows(y_ptr, qsl_ptr, B, T, stride_yt, c, c_ok, BLOCK_T, BLOCK_C)
        return
    start = tl.load(qsl_ptr + b).to(tl.int64)
    n = tl.load(qsl_ptr + b + 1).to(tl.int64) - start
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = (slot >= 0).to(tl.int32)  # a negative slot (graph padding): no history, nothing written
    # Positions from hist_lo on (-S with has_initial, else 0) read the history: no `& init` on the
    # masks (the interpreter of triton 3.9 makes a non-bool mask of a scalar bool & a tensor)
    hist_lo = -S * tl.load(init_ptr + b).to(tl.int32) * live
    hist_ptr = state_ptr + slot * stride_sn + c * stride_sc  # [BLOCK_C]: column 0 of each channel's history
    x_seq = x_ptr + start * stride_xt
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    rows = tl.arange(0, BLOCK_T)
    for t0 in range(0, n, BLOCK_T):
        r = t0 + rows  # positions in the sequence
        r_ok = r < n
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32) + bias[None, :]
        for j in tl.static_range(K):
            w = tl.load(w_ptr + c * stride_wc + j * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
            p = r - S + j  # the input position tap j reads
            ok = r_ok & (p >= 0)
            xj = tl.load(x_seq + p[:, None] * stride_xt + c[None, :], mask=ok[:, None] & c_ok[None, :],
                         other=0.0).to(tl.float32)
            if j < S:  # positions before the sequence: the history (tap S reads the row itself)
                from_hist = r_ok & (p < 0) & (p >= hist_lo)
                xj += tl.load(hist_ptr[None, :] + (S + p)[:, None] * stride_ss,
                              mask=from_hist[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            acc += w[None, :] * xj
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(y_ptr + (start + r)[:, None] * stride_yt + c[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & c_ok[None, :])
    if S > 0:
        # The new history: positions n - S .. n - 1 of (history ++ tokens); those before the
        # sequence are old history columns n + s, all read before the barrier, written after it.
        s = tl.arange(0, S_PAD)
        p = n - S + s
        s_ok = s < S
        new = tl.load(x_seq + p[None, :] * stride_xt + c[:, None], mask=c_ok[:, None] & (s_ok & (p >= 0))[None, :],
                      other=0.0).to(tl.float32)
        new += tl.load(hist_ptr[:, None] + (S + p)[None, :] * stride_ss,
                       mask=c_ok[:, None] & (s_ok & (p < 0) & (p >= hist_lo))[None, :], other=0.0).to(tl.float32)
        tl.debug_barrier()
        tl.store(hist_ptr[:, None] + s[None, :] * stride_ss, new.to(state_ptr.dtype.element_ty),
                 mask=c_ok[:, None] & (s < S * live)[None, :])


def conv_blocks(T: int, B: int, C: int, block_c: int | None = None) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_C) of the conv from shapes: about a sequence's share of T tokens a tile (1 in
    a decode step), at most CONV_MAX_BLOCK_T, and channels to fill CONV_TILE (block_c: given)."""
    block_t = min(CONV_MAX_BLOCK_T, triton.next_power_of_2(max(1, triton.cdiv(T, max(B, 1)))))
    if block_c is None:
        block_c = min(CONV_BLOCK_C, CONV_TILE // block_t)
    return block_t, min(block_c, max(16, triton.next_power_of_2(C)))


def _batch_args(T: int, query_start_loc, slots_B: torch.Tensor, has_initial_B: torch.Tensor,
                device: torch.device) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks the varlen layout and the slot arguments; returns (B, query_start_loc, slots, has_initial)
    as device tensors (int32/int64 [B+1], int32/int64 [B], uint8 [B]). A host list of offsets is
    checked (0, non-decreasing, at most T) and uploaded; a tensor is taken as it is (its values are
    not read on the host, so nothing synchronises)."""
    if not isinstance(slots_B, torch.Tensor) or slots_B.dim() != 1 or slots_B.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots_B must be an int64 (or int32) [B] tensor, got "
                         f"{getattr(slots_B, 'dtype', type(slots_B))} {tuple(getattr(slots_B, 'shape', ()))}")
    B = slots_B.shape[0]
    if not isinstance(has_initial_B, torch.Tensor) or has_initial_B.shape != (B,) or has_initial_B.dtype != torch.bool:
        raise ValueError(f"has_initial_B must be a bool [B={B}] tensor, got "
                         f"{getattr(has_initial_B, 'dtype', type(has_initial_B))} "
                         f"{tuple(getattr(has_initial_B, 'shape', ()))}")
    if isinstance(query_start_loc, torch.Tensor):
        if query_start_loc.shape != (B + 1,) or query_start_loc.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"query_start_loc must be an int32/int64 [B+1={B + 1}] tensor, got "
                             f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
        qsl = query_start_loc.to(device).contiguous()
    else:
        qsl_list = [int(x) for x in query_start_loc]
        if len(qsl_list) != B + 1:
            raise ValueError(f"query_start_loc has {len(qsl_list)} offsets, expected B+1 = {B + 1}")
        if qsl_list[0] != 0 or qsl_list[-1] > T:
            raise ValueError(f"query_start_loc must run from 0 to at most T={T}, got {qsl_list[0]} .. {qsl_list[-1]}")
        if any(b < a for a, b in zip(qsl_list, qsl_list[1:])):
            raise ValueError(f"query_start_loc must be non-decreasing, got {qsl_list}")
        qsl = torch.tensor(qsl_list, dtype=torch.int32 if T < 2 ** 31 else torch.int64, device=device)
    # The kernels index them densely: a strided view (a block-table column) is copied.
    return B, qsl, slots_B.to(device).contiguous(), has_initial_B.to(device).contiguous().view(torch.uint8)


def _check_rows(name: str, t: torch.Tensor, shape: tuple, device: torch.device) -> None:
    """t must have `shape` ([T, ...]), sit on `device` and have a unit stride along its last dim."""
    if t.shape != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride along its last dim, got strides {t.stride()}")


def causal_conv1d_varlen_triton(x_TC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None,
                                query_start_loc, conv_state_NCS: torch.Tensor, slots_B: torch.Tensor,
                                has_initial_B: torch.Tensor, activation: str | None = "silu", *,
                                block_c: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """Depthwise causal conv of each sequence over time from its conv state (module docstring;
    semantics of kernels.gated_delta.causal_conv1d_varlen); returns y [T, C] in x's dtype, fp32
    accumulation, activation "silu" or None; writes conv_state_NCS[slots_B[b]] in place.

    x_TC: [T, C], any row stride, unit stride along C. weight_CK: [C, K], bias_C: [C] or None.
    conv_state_NCS: [N, C, S = K - 1], any strides, any float dtype. query_start_loc: host list or
    int32/int64 device tensor of B + 1 offsets (query_start_loc[B] <= T: later rows come out zero).
    slots_B: int64/int32 [B], distinct; has_initial_B: bool [B].
    block_c: channels a program (power of two); None = conv_blocks' choice.
    """
    if x_TC.dim() != 2:
        raise ValueError(f"x_TC must be [T, C], got {list(x_TC.shape)}")
    T, C = x_TC.shape
    dev = x_TC.device
    _check_rows("x_TC", x_TC, (T, C), dev)
    if weight_CK.dim() != 2 or weight_CK.shape[0] != C or not 1 <= weight_CK.shape[1] <= MAX_TAPS:
        raise ValueError(f"weight_CK must be [C={C}, K] with 1 <= K <= {MAX_TAPS}, got {list(weight_CK.shape)}")
    if weight_CK.device != dev:
        raise ValueError(f"weight_CK is on {weight_CK.device}, expected {dev}")
    K = weight_CK.shape[1]
    S = K - 1
    if bias_C is not None:
        _check_rows("bias_C", bias_C, (C,), dev)
    if conv_state_NCS.dim() != 3 or conv_state_NCS.shape[1:] != (C, S):
        raise ValueError(f"conv_state_NCS must be [N, C={C}, S={S}], got {list(conv_state_NCS.shape)}")
    if conv_state_NCS.device != dev or not conv_state_NCS.is_floating_point():
        raise ValueError(f"conv_state_NCS must be a float tensor on {dev}, got {conv_state_NCS.dtype} on "
                         f"{conv_state_NCS.device}")
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if block_c is not None and (block_c < 1 or block_c & (block_c - 1)):
        raise ValueError(f"block_c must be a power of two, got {block_c}")
    B, qsl, slots, init = _batch_args(T, query_start_loc, slots_B, has_initial_B, dev)
    y_TC = torch.empty(T, C, dtype=x_TC.dtype, device=dev)
    if C == 0:
        return y_TC
    block_t, block_c = conv_blocks(T, B, C, block_c)
    _causal_conv1d_kernel[(B + 1, triton.cdiv(C, block_c))](
        x_TC, weight_CK, bias_C if bias_C is not None else weight_CK, qsl, conv_state_NCS, slots, init, y_TC,
        T, C, x_TC.stride(0), y_TC.stride(0), weight_CK.stride(0), weight_CK.stride(1),
        *conv_state_NCS.stride(),
        K=K, S=S, S_PAD=triton.next_power_of_2(max(S, 1)), BLOCK_T=block_t, BLOCK_C=block_c,
        HAS_BIAS=bias_C is not None, SILU=activation == "silu", num_warps=num_warps, **pdl_launch(x_TC))
    return y_TC


# --- the gated delta rule --------------------------------------------------------------------------

@triton.jit
def _load_token(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t, ok, kh, h, stride_qt, stride_qh, stride_kt, stride_kh,
                stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh, dk, dv, scale,
                DK: tl.constexpr, DV: tl.constexpr, L2NORM: tl.constexpr):
    """Token t's q and k (of key head kh; L2-normalised with L2NORM, q scaled), v (the columns dv
    of value head h), g and beta, all fp32; zeros where not ok (past the sequence)."""
    # Limits instead of `dk_ok & ok`: the interpreter of triton 3.9 makes a non-bool mask of a
    # tensor & a scalar bool
    dk_lim = tl.where(ok, DK, 0)
    dv_lim = tl.where(ok, DV, 0)
    q = tl.load(q_ptr + t * stride_qt + kh * stride_qh + dk, mask=dk < dk_lim, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + t * stride_kt + kh * stride_kh + dk, mask=dk < dk_lim, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + dv, mask=dv < dv_lim, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * stride_gt + h * stride_gh, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + t * stride_bt + h * stride_bh, mask=ok, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.math.rsqrt(tl.sum(q * q, 0) + 1e-6)
        k = k * tl.math.rsqrt(tl.sum(k * k, 0) + 1e-6)
    return q * scale, k, v, g, beta


@triton.jit
def load_state_slice(state_ptr, slots_ptr, init_ptr, b, h, dk, dv, dv_ok, stride_sn, stride_sh,
                     DK: tl.constexpr, DV: tl.constexpr):
    """Sequence b's state slice [len(dk), len(dv)] (fp32) of value head h: its slot's rows dk,
    columns dv, or zeros without has_initial or for a negative slot (a graph's padding sequence).
    Returns (the slice, its pointers, whether the slot is real: 1 or 0)."""
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = (slot >= 0).to(tl.int32)  # a negative slot: zeros read, nothing written
    init_rows = DK * tl.load(init_ptr + b).to(tl.int32) * live  # rows of the prior state read: DK or 0 (zeros)
    s_ptrs = state_ptr + slot * stride_sn + h * stride_sh + dk[:, None] * DV + dv[None, :]
    return tl.load(s_ptrs, mask=(dk < init_rows)[:, None] & dv_ok[None, :], other=0.0), s_ptrs, live


@triton.jit
def store_state_slice(s_ptrs, state, live, dk, dv_ok, DK: tl.constexpr):
    """The new state slice back to its slot (not for a negative one), after every thread's read of the old."""
    tl.debug_barrier()
    tl.store(s_ptrs, state, mask=(dk < DK * live)[:, None] & dv_ok[None, :])


@triton.jit(do_not_specialize=["T", "long_from"])
def _gated_delta_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, qsl_ptr, state_ptr, slots_ptr, init_ptr,
                                  o_ptr, T, long_from, scale, stride_qt, stride_qh, stride_kt, stride_kh,
                                  stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh, stride_ot,
                                  stride_oh, stride_sn, stride_sh, GROUP: tl.constexpr, DK: tl.constexpr,
                                  DV: tl.constexpr, DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
                                  USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    B = tl.num_programs(0) - 1
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    dv_ok = dv < DV
    o_head = o_ptr + h * stride_oh + dv
    if b == B:  # rows past the batch: zeros
        for t in range(tl.load(qsl_ptr + B).to(tl.int64), T):
            tl.store(o_head + t * stride_ot, tl.zeros([BLOCK_V], dtype=o_ptr.dtype.element_ty), mask=dv_ok)
        return
    start = tl.load(qsl_ptr + b).to(tl.int64)
    end = tl.load(qsl_ptr + b + 1).to(tl.int64)
    if end - start >= long_from:  # the chunked kernel's (kernels/triton_gated_delta_chunked.py)
        return
    kh = h // GROUP
    dk = tl.arange(0, DK_PAD)
    state, s_ptrs, live = load_state_slice(state_ptr, slots_ptr, init_ptr, b, h, dk, dv, dv_ok, stride_sn, stride_sh,
                                           DK, DV)
    q, k, v, g, beta = _load_token(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, start, start < end, kh, h,
                                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                                   stride_gt, stride_gh, stride_bt, stride_bh, dk, dv, scale, DK, DV, L2NORM)
    for t in range(start, end):
        # the next token's inputs first: their loads overlap this token's arithmetic
        qn, kn, vn, gn, betan = _load_token(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t + 1, t + 1 < end, kh, h,
                                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                                            stride_gt, stride_gh, stride_bt, stride_bh, dk, dv, scale, DK, DV,
                                            L2NORM)
        state = state * tl.exp(g)
        delta = beta * (v - tl.sum(state * k[:, None], 0))  # [BLOCK_V]
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(state * q[:, None], 0)
        tl.store(o_head + t * stride_ot, o.to(o_ptr.dtype.element_ty), mask=dv_ok)
        q, k, v, g, beta = qn, kn, vn, gn, betan
    store_state_slice(s_ptrs, state, live, dk, dv_ok, DK)


def gated_delta_rule_recurrent_triton(q_TKd: torch.Tensor, k_TKd: torch.Tensor, v_TVe: torch.Tensor,
                                      g_TV: torch.Tensor, beta_TV: torch.Tensor, query_start_loc,
                                      ssm_state_NVde: torch.Tensor, slots_B: torch.Tensor, has_initial_B: torch.Tensor,
                                      scale: float | None = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
                                      *, block_v: int = DEFAULT_BLOCK_V, num_warps: int | None = None) -> torch.Tensor:
    """The gated delta rule of each sequence from its state, token by token (module docstring;
    semantics of kernels.gated_delta.gated_delta_rule_varlen); returns o [T, Hv, Dv] in q's dtype
    and writes the final states to ssm_state_NVde[slots_B[b]] in place. chunk_size is ignored.

    q_TKd, k_TKd: [T, Hk, Dk]; v_TVe: [T, Hv, Dv] (Hv a multiple of Hk); g_TV (log decay), beta_TV:
    [T, Hv]; any strides with a unit stride along the last dim (views of a fused projection are
    fine). Dk, Dv <= 256. ssm_state_NVde: fp32 [N, Hv, Dk, Dv], each [Dk, Dv] contiguous.
    query_start_loc, slots_B, has_initial_B: as causal_conv1d_varlen_triton.
    scale: q's scale after the norm (default Dk ** -0.5). block_v: value columns a program (power
    of two); num_warps: None = 4, or 8 for state slices over 8192 values.
    """
    check_delta_args(q_TKd, k_TKd, v_TVe, g_TV, beta_TV, ssm_state_NVde)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    B, qsl, slots, init = _batch_args(q_TKd.shape[0], query_start_loc, slots_B, has_initial_B, q_TKd.device)
    o_TVe = torch.empty(v_TVe.shape, dtype=q_TKd.dtype, device=q_TKd.device)
    launch_recurrent(q_TKd, k_TKd, v_TVe, g_TV, beta_TV, qsl, ssm_state_NVde, slots, init, o_TVe, scale,
                     use_qk_l2norm, block_v, num_warps)
    return o_TVe


def check_delta_args(q_TKd: torch.Tensor, k_TKd: torch.Tensor, v_TVe: torch.Tensor, g_TV: torch.Tensor,
                     beta_TV: torch.Tensor, ssm_state_NVde: torch.Tensor) -> None:
    """The delta rule's tensors: shapes, devices, dtypes and strides (see gated_delta_rule_recurrent_triton)."""
    if q_TKd.dim() != 3:
        raise ValueError(f"q_TKd must be [T, Hk, Dk], got {list(q_TKd.shape)}")
    T, Hk, Dk = q_TKd.shape
    dev = q_TKd.device
    _check_rows("q_TKd", q_TKd, (T, Hk, Dk), dev)
    _check_rows("k_TKd", k_TKd, (T, Hk, Dk), dev)
    if v_TVe.dim() != 3 or v_TVe.shape[0] != T:
        raise ValueError(f"v_TVe must be [T={T}, Hv, Dv], got {list(v_TVe.shape)}")
    Hv, Dv = v_TVe.shape[1:]
    _check_rows("v_TVe", v_TVe, (T, Hv, Dv), dev)
    if Hk == 0 or Hv % Hk:
        raise ValueError(f"the value heads ({Hv}) must be a multiple of the key heads ({Hk})")
    if not (1 <= Dk <= MAX_HEAD_DIM and 1 <= Dv <= MAX_HEAD_DIM):
        raise ValueError(f"head dims must be 1 .. {MAX_HEAD_DIM}, got Dk={Dk}, Dv={Dv}")
    _check_rows("g_TV", g_TV, (T, Hv), dev)
    _check_rows("beta_TV", beta_TV, (T, Hv), dev)
    if ssm_state_NVde.dim() != 4 or ssm_state_NVde.shape[1:] != (Hv, Dk, Dv):
        raise ValueError(f"ssm_state_NVde must be [N, Hv={Hv}, Dk={Dk}, Dv={Dv}], got {list(ssm_state_NVde.shape)}")
    if ssm_state_NVde.dtype != torch.float32 or ssm_state_NVde.device != dev:
        raise ValueError(f"ssm_state_NVde must be float32 on {dev}, got {ssm_state_NVde.dtype} on "
                         f"{ssm_state_NVde.device}")
    if ssm_state_NVde.stride(3) != 1 or ssm_state_NVde.stride(2) != Dv:
        raise ValueError(f"ssm_state_NVde's [Dk, Dv] state matrices must be contiguous, got strides "
                         f"{ssm_state_NVde.stride()}")


def launch_recurrent(q_TKd, k_TKd, v_TVe, g_TV, beta_TV, qsl, ssm_state_NVde, slots, init, o_TVe, scale,
                     use_qk_l2norm: bool, block_v: int, num_warps: int | None, long_from: int = 2 ** 31 - 1) -> None:
    """The recurrent kernel over checked arguments (qsl, slots, init from _batch_args) into o_TVe;
    sequences of long_from tokens or more are left alone (their outputs and states unwritten)."""
    Hk, Dk = q_TKd.shape[1:]
    Hv, Dv = v_TVe.shape[1:]
    if Hv == 0:
        return
    dk_pad = triton.next_power_of_2(Dk)
    block_v = min(block_v, triton.next_power_of_2(Dv))
    if num_warps is None:
        num_warps = 4 if dk_pad * block_v <= 4096 else 8
    _gated_delta_recurrent_kernel[(slots.shape[0] + 1, Hv, triton.cdiv(Dv, block_v))](
        q_TKd, k_TKd, v_TVe, g_TV, beta_TV, qsl, ssm_state_NVde, slots, init, o_TVe, q_TKd.shape[0], long_from,
        float(Dk ** -0.5 if scale is None else scale),
        q_TKd.stride(0), q_TKd.stride(1), k_TKd.stride(0), k_TKd.stride(1), v_TVe.stride(0), v_TVe.stride(1),
        g_TV.stride(0), g_TV.stride(1), beta_TV.stride(0), beta_TV.stride(1), o_TVe.stride(0), o_TVe.stride(1),
        ssm_state_NVde.stride(0), ssm_state_NVde.stride(1),
        GROUP=Hv // Hk, DK=Dk, DV=Dv, DK_PAD=dk_pad, BLOCK_V=block_v, L2NORM=bool(use_qk_l2norm),
        num_warps=num_warps, **pdl_launch(q_TKd))
