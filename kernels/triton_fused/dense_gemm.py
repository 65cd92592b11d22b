"""y = x @ w.T (+ bias) for decode batches of tens to hundreds of rows: a tiled Triton GEMM that
launches with PDL (kernels/pdl.py), for the dense projections where cuBLAS's kernels run far off
their bytes inside a decode graph.

Legend: M rows of x, N output features, K input features, S split-K parts; BLOCK_M x BLOCK_N
output tile per program, BLOCK_K the K chunk per loop step.

At M <= a few hundred a projection streams W ([N, K], read once from HBM) while x ([M, K]) stays
in L2, so the tiling spreads W over enough programs to fill the SMs: programs of one column
block sit next to each other in the grid (their W tile is read from HBM once and from L2 by the
others), and split-K (S > 1) shares K out when the column blocks alone are too few; the S fp32
partials go to a [S, M, N] workspace that the skinny GEMM's reduce kernel sums in a fixed order.
Each program reads its first W tile before waiting for the previous kernel (weights are never
written by a kernel of a forward), so the weight stream starts under that kernel's tail; cuBLAS's
kernels cannot overlap their neighbours that way.

Rounding: fp32 accumulation ("ieee" for fp32 inputs: no tf32), bias added in fp32, rounded once
to x's dtype (as cuBLAS does); only the fp32 summation order differs from torch's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch
from kernels.triton_fused.common import check_float, check_same_device, interpreting, round_to, unit_last_stride
from kernels.triton_fused.skinny_gemm import _k_offsets, _splitk_reduce_kernel

DEFAULT_NUM_SMS = 132  # H200


class DenseConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def dense_config(M: int, N: int, K: int, num_sms: int = DEFAULT_NUM_SMS) -> DenseConfig:
    """The default tiling (benchmarks/bench_dense_gemm.py sweeps others): row blocks of up to 64,
    64-column blocks, and split-K until there are about two programs per SM."""
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    block_n, block_k = 64, 128
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    k_steps = triton.cdiv(K, block_k)
    split_k = 1
    while tiles * split_k < 2 * num_sms and split_k * 2 <= min(8, k_steps // 2):
        split_k *= 2
    return DenseConfig(block_m, block_n, block_k, split_k, num_warps=4, num_stages=4)


@triton.jit
def _dot_step(acc, x, w, INTERPRET: tl.constexpr):
    """acc += x @ w^T for an x tile [BM, BK] and a W tile [BN, BK]."""
    if x.dtype == tl.float32:
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    elif INTERPRET:  # the CPU interpreter's dot mishandles bf16; half products are exact in fp32
        acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        acc += tl.dot(x, tl.trans(w))
    return acc


@triton.jit
def _dense_gemm_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, k_per_split,
                       stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                       INTERPRET: tl.constexpr, USE_PDL: tl.constexpr):
    num_m = tl.cdiv(M, BLOCK_M)
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    pid_m, pid_n = pid % num_m, pid // num_m  # the row blocks of one column block side by side
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    offs_k, k_mask = _k_offsets(k_lo, K, BLOCK_K, EVEN_K)
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # before the wait
    pdl_enter(USE_PDL)
    x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    acc = _dot_step(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), x, w, INTERPRET)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        offs_k, k_mask = _k_offsets(k0, K, BLOCK_K, EVEN_K)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _dot_step(acc, x, w, INTERPRET)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if IS_SPLIT:
        tl.store(ws_ptr + (pid_k * M + offs_m)[:, None] * N + offs_n[None, :], acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = round_to(acc, y_ptr.dtype.element_ty, INTERPRET)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=out_mask)


def _check_config(cfg: DenseConfig) -> None:
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"config {name} must be a power of two >= 16, got {v}")
    if cfg.split_k < 1 or cfg.num_warps < 1 or cfg.num_warps & (cfg.num_warps - 1):
        raise ValueError(f"config split_k must be >= 1 and num_warps a power of two, got {cfg}")


def dense_linear(x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
                 config: DenseConfig | None = None) -> torch.Tensor:
    """F.linear(x_MK, w_NK, bias_N) as a new contiguous [M, N] tensor in x's dtype.

    x_MK: [M, K], any row stride (a non-unit last stride is copied). w_NK: [N, K] with a contiguous
    last dimension (any row stride). bias_N: [N] or None. All of one dtype (fp32, fp16 or bf16)
    and device. config: a DenseConfig to use instead of dense_config's (benchmark sweeps).
    """
    check_float("x", x_MK)
    if x_MK.dim() != 2 or w_NK.dim() != 2:
        raise ValueError(f"x must be [M, K] and w [N, K], got {tuple(x_MK.shape)} and {tuple(w_NK.shape)}")
    (M, K), N = x_MK.shape, w_NK.shape[0]
    if w_NK.shape[1] != K:
        raise ValueError(f"w must be [N, {K}] (x's K), got {tuple(w_NK.shape)}")
    tensors = {"x": x_MK, "w": w_NK}
    if bias_N is not None:
        if bias_N.shape != (N,):
            raise ValueError(f"bias must be [{N}] (w's N), got {tuple(bias_N.shape)}")
        tensors["bias"] = bias_N
    dtypes = {n: t.dtype for n, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"x, w and bias must have one dtype, got {dtypes}")
    check_same_device(**tensors)
    if K > 1 and w_NK.stride(1) != 1:
        raise ValueError("w must have a contiguous last dimension (a copy per call would cost more than the GEMM)")
    x = unit_last_stride(x_MK)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.copy_(bias_N.expand(M, N)) if bias_N is not None else y.zero_()
    cfg = config if config is not None else dense_config(M, N, K)
    _check_config(cfg)
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(K, k_per_split)  # rounding k_per_split up may leave trailing parts empty
    is_split = split_k > 1
    ws = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device) if is_split else y
    bias = bias_N if bias_N is not None else y  # unused when HAS_BIAS is off
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), split_k)
    _dense_gemm_kernel[grid](
        x, w_NK, bias, y, ws, M, N, K, k_per_split, x.stride(0), w_NK.stride(0), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IS_SPLIT=is_split,
        HAS_BIAS=bias_N is not None, EVEN_K=K % cfg.block_k == 0 and K % k_per_split == 0,
        INTERPRET=interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x))
    if is_split:
        block = min(1024, triton.next_power_of_2(M * N))
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](
            ws, bias, y, M * N, N, SPLIT_K=split_k, HAS_BIAS=bias_N is not None, BLOCK=block,
            INTERPRET=interpreting(), num_warps=4, **pdl_launch(y))
    return y
