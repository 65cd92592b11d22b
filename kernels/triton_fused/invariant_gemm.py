"""y = x @ w.T (+ bias) with one fixed tiling whatever the number of rows: the dense GEMM of the
batch-invariant mode (kernels/batch_invariant.py).

Legend: M rows of x, N output features, K input features.

cuBLAS picks its algorithm (tile shapes, split-K) from M, so a row's sum over K depends on how
many rows share the call. Here every program owns a BLOCK_M x BLOCK_N output tile and walks K in
BLOCK_K steps from 0, accumulating in fp32 with tl.dot: an output element's arithmetic depends
only on its row of x and its column of w (rows past M read as zeros and change no other row).
No split-K, no atomics; M is not specialised on, so every M runs one compiled kernel.
Rounding: fp32 accumulation, bias added in fp32, rounded once to x's dtype, as cuBLAS does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_attention.common import dot_flags

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit(do_not_specialize=["M"])
def _invariant_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k[None, :] < K), other=0.0)
        w = tl.load(w_cols + k[:, None], mask=n_ok[None, :] & (k[:, None] < K), other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong; fp32 is exact there
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def invariant_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] (unit stride along K), weight [N, K]; the output
    in x's dtype, each row computed as if alone."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x [..., {x.shape[-1]}] and weight {tuple(weight.shape)} do not match")
    if x.device != weight.device:
        raise ValueError(f"x on {x.device}, weight on {weight.device}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    M, K = x2.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        precision, upcast = dot_flags(x.dtype)
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
        _invariant_gemm_kernel[grid](x2, w, y if bias is None else bias, y, M, N, K, x2.stride(0), w.stride(0),
                                     y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                     BLOCK_K=BLOCK_K, PRECISION=precision, UPCAST=upcast,
                                     num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y.reshape(*shape[:-1], N)
