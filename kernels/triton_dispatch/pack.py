"""Triton launches of the dispatch steps: fixed-capacity (route, pack, unpack, combine) and
variable-size (route with C = T, pack_var, unpack_var, the same combine); references and legend:
reference.py.

Imported only when a kernel runs: a module that decorates Triton kernels must not be imported
before the tests set TRITON_INTERPRET (tests/kernels/conftest.py).

BLOCK_T tokens per step of the route scan, BLOCK_W x words and BLOCK_D hidden columns per
program, BLOCK_R rows per unpack program, KP = K rounded up to a power of two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 128
BLOCK_W = 512
BLOCK_D = 512
BLOCK_R = 64


@triton.jit(do_not_specialize=["T"])
def _route_kernel(ids_ptr, owner_ptr, row_ptr, tok_ptr, counts_ptr, T, K: tl.constexpr, KP: tl.constexpr,
                  C: tl.constexpr, P: tl.constexpr, BLOCK_T: tl.constexpr):
    # One program per destination p scans the tokens in order: slot = prefix count of the
    # tokens going to p, so the layout is deterministic (no atomics).
    p = tl.program_id(0)
    k = tl.arange(0, KP)
    carry = tl.zeros([], dtype=tl.int64)
    for start in range(0, T, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        in_t = t < T
        m = in_t[:, None] & (k[None, :] < K)
        ids = tl.load(ids_ptr + t[:, None].to(tl.int64) * K + k[None, :], mask=m, other=0).to(tl.int64)
        owner = tl.load(owner_ptr + ids, mask=m, other=-1)
        goes = tl.max(((owner == p) & m).to(tl.int64), axis=1)
        pos = tl.cumsum(goes, axis=0) + carry  # inclusive: slot + 1
        kept = (goes > 0) & (pos <= C)
        row = tl.where(kept, p * C + pos - 1, P * C)
        tl.store(row_ptr + p * T + t, row, mask=in_t)
        tl.store(tok_ptr + p * C + pos - 1, t.to(tl.int64), mask=in_t & kept)
        carry += tl.sum(goes, axis=0)
    tl.store(counts_ptr + p, carry)
    for s0 in range(0, C, BLOCK_T):  # slots nobody took are padding
        s = s0 + tl.arange(0, BLOCK_T)
        tl.store(tok_ptr + p * C + s, tl.full([BLOCK_T], -1, tl.int64), mask=(s < C) & (s >= carry))


@triton.jit(do_not_specialize=["W", "out_w_stride", "out_m_stride"])
def _pack_kernel(x_ptr, w_ptr, ids_ptr, owner_ptr, tok_ptr, counts_ptr, pad_ptr, out_w_ptr, out_m_ptr,
                 W, out_w_stride, out_m_stride, K: tl.constexpr, KP: tl.constexpr, C: tl.constexpr,
                 BLOCK_W: tl.constexpr):
    # Scalars are loaded as broadcast vectors (`+ 0 * cols`): the interpreter cannot mask with
    # a scalar & vector combination.
    n = tl.program_id(0).to(tl.int64)
    p = n // C
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    in_w = cols < W
    tok = tl.load(tok_ptr + n + 0 * cols)
    valid = tok >= 0
    tok = tl.where(valid, tok, 0)
    words = tl.load(x_ptr + tok * W + cols, mask=in_w & valid, other=0)
    tl.store(out_w_ptr + n * out_w_stride + cols, words, mask=in_w)
    if tl.program_id(1) == 0:
        # New names: the compiler refuses to rebind `tok` / `valid` to another shape in this block.
        k = tl.arange(0, KP)
        km = k < K
        tok_k = tl.load(tok_ptr + n + 0 * k)
        valid_k = tok_k >= 0
        tok_k = tl.where(valid_k, tok_k, 0)
        ids = tl.load(ids_ptr + tok_k * K + k, mask=km & valid_k, other=0).to(tl.int64)
        w = tl.load(w_ptr + tok_k * K + k, mask=km & valid_k, other=0.0).to(tl.float32)
        owner = tl.load(owner_ptr + ids, mask=km, other=-1)
        w = tl.where(valid_k & (owner == p), w, 0.0)
        ids = tl.where(valid_k, ids, tl.load(pad_ptr + p + 0 * k))
        meta = out_m_ptr + n * out_m_stride
        tl.store(meta + k, w.to(tl.int32, bitcast=True), mask=km)
        tl.store(meta + K + k, ids.to(tl.int32), mask=km)
        tl.store(meta + 2 * K, tl.load(counts_ptr + p).to(tl.int32))


@triton.jit(do_not_specialize=["N", "m_stride"])
def _unpack_kernel(meta_ptr, w_out_ptr, ids_out_ptr, counts_out_ptr, N, m_stride, K: tl.constexpr,
                   KP: tl.constexpr, C: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    k = tl.arange(0, KP)
    m = (r < N)[:, None] & (k < K)[None, :]
    row = meta_ptr + r[:, None] * m_stride
    w = tl.load(row + k[None, :], mask=m, other=0).to(tl.float32, bitcast=True)
    ids = tl.load(row + K + k[None, :], mask=m, other=0)
    tl.store(w_out_ptr + r[:, None] * K + k[None, :], w, mask=m)
    tl.store(ids_out_ptr + r[:, None] * K + k[None, :], ids.to(ids_out_ptr.dtype.element_ty), mask=m)
    first = (r < N) & (r % C == 0)
    count = tl.load(meta_ptr + r * m_stride + 2 * K, mask=first, other=0)
    tl.store(counts_out_ptr + r // C, count.to(tl.int64), mask=first)


@triton.jit(do_not_specialize=["T", "D"])
def _combine_kernel(back_ptr, row_ptr, out_ptr, T, D, P: tl.constexpr, N: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for p in tl.static_range(P):  # fixed order: the sum is deterministic
        row = tl.load(row_ptr + p * T + t + 0 * d)
        acc += tl.load(back_ptr + row * D + d, mask=dm & (row < N), other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + d, acc.to(out_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _compact_row(counts_ptr, n, T, p, zeros, P: tl.constexpr):
    """Row of capacity slot n = p*T + pos among the S rows sent back to back by destination:
    pos plus the counts of the destinations before p (broadcast to zeros' shape)."""
    offset = zeros.to(tl.int64)
    for q in tl.static_range(P):
        offset += tl.where(q < p, tl.load(counts_ptr + q + zeros), 0)
    return offset + n - p * T


@triton.jit(do_not_specialize=["T", "W", "out_w_stride", "out_m_stride"])
def _pack_var_kernel(x_ptr, w_ptr, ids_ptr, owner_ptr, tok_ptr, counts_ptr, row_ptr, out_w_ptr, out_m_ptr,
                     T, W, out_w_stride, out_m_stride, K: tl.constexpr, KP: tl.constexpr, P: tl.constexpr,
                     BLOCK_W: tl.constexpr):
    # Program n = p*T + pos of route's capacity layout (C = T); past the destination's count
    # (tok -1) it writes nothing. Scalars are broadcast vectors, as in _pack_kernel.
    n = tl.program_id(0).to(tl.int64)
    p = n // T
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    zc = 0 * cols
    tok = tl.load(tok_ptr + n + zc)
    valid = tok >= 0
    dest = _compact_row(counts_ptr, n, T, p, zc, P)
    m = (cols < W) & valid
    words = tl.load(x_ptr + tl.where(valid, tok, 0) * W + cols, mask=m, other=0)
    tl.store(out_w_ptr + dest * out_w_stride + cols, words, mask=m)
    if tl.program_id(1) == 0:
        k = tl.arange(0, KP)
        zk = 0 * k
        tok_k = tl.load(tok_ptr + n + zk)
        mk = (k < K) & (tok_k >= 0)
        tok_k = tl.where(tok_k >= 0, tok_k, 0)
        dest_k = _compact_row(counts_ptr, n, T, p, zk, P)
        ids = tl.load(ids_ptr + tok_k * K + k, mask=mk, other=0).to(tl.int64)
        w = tl.load(w_ptr + tok_k * K + k, mask=mk, other=0.0).to(tl.float32)
        owner = tl.load(owner_ptr + ids, mask=mk, other=-1)
        w = tl.where(owner == p, w, 0.0)
        meta = out_m_ptr + dest_k * out_m_stride
        tl.store(meta + k, w.to(tl.int32, bitcast=True), mask=mk)
        tl.store(meta + K + k, ids.to(tl.int32), mask=mk)
        tl.store(row_ptr + p * T + tok_k, dest_k, mask=mk & (k == 0))


@triton.jit(do_not_specialize=["R", "m_stride"])
def _unpack_var_kernel(meta_ptr, w_out_ptr, ids_out_ptr, R, m_stride, K: tl.constexpr, KP: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    k = tl.arange(0, KP)
    m = (r < R)[:, None] & (k < K)[None, :]
    row = meta_ptr + r[:, None] * m_stride
    tl.store(w_out_ptr + r[:, None] * K + k[None, :],
             tl.load(row + k[None, :], mask=m, other=0).to(tl.float32, bitcast=True), mask=m)
    ids = tl.load(row + K + k[None, :], mask=m, other=0)
    tl.store(ids_out_ptr + r[:, None] * K + k[None, :], ids.to(ids_out_ptr.dtype.element_ty), mask=m)


def route_triton(ids_TK: torch.Tensor, owner_E: torch.Tensor, P: int, C: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, K = ids_TK.shape
    dev = ids_TK.device
    row_PT = torch.empty(P, T, dtype=torch.int64, device=dev)
    tok_N = torch.empty(P * C, dtype=torch.int64, device=dev)
    counts_P = torch.empty(P, dtype=torch.int64, device=dev)
    _route_kernel[(P,)](ids_TK, owner_E, row_PT, tok_N, counts_P, T, K=K, KP=triton.next_power_of_2(K), C=C, P=P,
                        BLOCK_T=BLOCK_T)
    return row_PT, tok_N, counts_P


def pack_triton(x_words_TW, weights_TK, ids_TK, owner_E, tok_N, counts_P, pad_id_P, out_words_NW, out_meta_NM,
                C: int) -> None:
    N, W = out_words_NW.shape
    K = ids_TK.shape[1]
    _pack_kernel[(N, triton.cdiv(W, BLOCK_W))](
        x_words_TW, weights_TK, ids_TK, owner_E, tok_N, counts_P, pad_id_P, out_words_NW, out_meta_NM, W,
        out_words_NW.stride(0), out_meta_NM.stride(0), K=K, KP=triton.next_power_of_2(K), C=C,
        BLOCK_W=min(BLOCK_W, triton.next_power_of_2(W)))


def unpack_triton(meta_NM, C: int, weights_out_NK, ids_out_NK, counts_out_P) -> None:
    N, K = ids_out_NK.shape
    _unpack_kernel[(triton.cdiv(N, BLOCK_R),)](meta_NM, weights_out_NK, ids_out_NK, counts_out_P, N,
                                               meta_NM.stride(0), K=K, KP=triton.next_power_of_2(K), C=C,
                                               BLOCK_R=BLOCK_R)


def combine_triton(back_ND, row_PT, out_TD) -> None:
    N, D = back_ND.shape
    P, T = row_PT.shape
    _combine_kernel[(T, triton.cdiv(D, BLOCK_D))](back_ND, row_PT, out_TD, T, D, P=P, N=N,
                                                  BLOCK_D=min(BLOCK_D, triton.next_power_of_2(D)))


def pack_var_triton(x_words_TW, weights_TK, ids_TK, owner_E, tok_N, counts_P, row_PT, out_words_SW,
                    out_meta_SM) -> None:
    P, T = row_PT.shape
    W, K = out_words_SW.shape[1], ids_TK.shape[1]
    if T == 0:
        return
    _pack_var_kernel[(P * T, triton.cdiv(W, BLOCK_W))](
        x_words_TW, weights_TK, ids_TK, owner_E, tok_N, counts_P, row_PT, out_words_SW, out_meta_SM, T, W,
        out_words_SW.stride(0), out_meta_SM.stride(0), K=K, KP=triton.next_power_of_2(K), P=P,
        BLOCK_W=min(BLOCK_W, triton.next_power_of_2(W)))


def unpack_var_triton(meta_RM, weights_out_RK, ids_out_RK) -> None:
    R, K = ids_out_RK.shape
    if R == 0:
        return
    _unpack_var_kernel[(triton.cdiv(R, BLOCK_R),)](meta_RM, weights_out_RK, ids_out_RK, R, meta_RM.stride(0), K=K,
                                                   KP=triton.next_power_of_2(K), BLOCK_R=BLOCK_R)
