"""y = x @ w.T (+ bias) for a few rows of x (decode at batch <= 16): a memory-bound skinny GEMM.

Legend: M rows of x (<= 16), N output features, K input features, S split-K parts;
BLOCK_M rows per program (all M of them), BLOCK_N output columns per program, BLOCK_K the K
chunk loaded per loop step.

At M <= 16 the whole cost is streaming W ([N, K], read exactly once) from HBM; x is tiny and
stays in cache. Each program owns BLOCK_N output columns for every row of x and streams its
[BLOCK_N, K / S] slab of W in [BLOCK_N, BLOCK_K] tiles with 16-byte loads along K.

Two ways to reduce a tile (SkinnyConfig.use_dot):
- rows (M <= 4): per row m, sum over K of w_tile * x_m in fp32 (a [BLOCK_N] partial per step);
- dot (M in 5..16): tl.dot of the [16, BLOCK_K] x tile (rows past M read as 0) with the W tile,
  fp32 accumulation ("ieee" for fp32 inputs: no tf32), which Triton software-pipelines.
Split-K (S > 1) spreads one column block over S programs so small N (router N=128, o_proj
N=2048) still fills the SMs: each writes an fp32 partial to a [S, M, N] workspace and a second
tiny launch sums the S partials in a fixed order (deterministic), adds the bias and rounds.
Both launches are CUDA-graph capturable: no host sync, and the workspace size depends only on
the shapes.

Rounding: fp32 accumulation, bias added in fp32, rounded once to x's dtype (as cuBLAS does);
only the fp32 summation order differs from torch's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch
from kernels.triton_fused.common import check_float, check_same_device, interpreting, round_to, unit_last_stride

MAX_M = 16
DEFAULT_NUM_SMS = 132  # H200


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    use_dot: bool = False
    num_stages: int = 3


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def skinny_config(M: int, N: int, K: int, elem_bytes: int = 2, num_sms: int = DEFAULT_NUM_SMS) -> SkinnyConfig:
    """The default tiling for an [M, K] x [N, K]^T product (benchmarks/bench_skinny.py sweeps others).

    - rows mode for M <= 4: big single-step tiles (BLOCK_K up to 4 KiB of a W row, BLOCK_N * BLOCK_K
      = 8 KiB of W per step) and many programs, so every load is issued up front and occupancy, not
      a software pipeline, hides the HBM latency;
    - dot mode for M > 4: 16 x BLOCK_K x 16 tiles, pipelined over K;
    - split-K when the column blocks alone give fewer than 2 programs per SM and K has several
      steps to share out.
    """
    if not 1 <= M <= MAX_M:
        raise ValueError(f"skinny_config handles 1..{MAX_M} rows, got M={M}")
    use_dot = M > 4
    tile_bytes = 8192
    if use_dot:
        block_k = max(16, min(triton.next_power_of_2(K), 512 // elem_bytes))  # tl.dot needs K >= 16
        block_n = 16
        num_warps, num_stages = 4, 4
    else:
        block_k = min(triton.next_power_of_2(K), 4096 // elem_bytes)
        block_n = max(1, min(_pow2_floor(tile_bytes // (block_k * elem_bytes)), triton.next_power_of_2(N)))
        num_warps, num_stages = 4, 3
    n_blocks = triton.cdiv(N, block_n)
    k_steps = triton.cdiv(K, block_k)
    split_k = 1
    while n_blocks * split_k < 2 * num_sms and split_k * 2 <= min(16, k_steps):
        split_k *= 2
    return SkinnyConfig(block_n, block_k, split_k, num_warps, use_dot, num_stages)


@triton.jit
def _k_offsets(k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:  # constant-true masks when the shape divides evenly keep the 16-byte loads vectorised
        k_mask = tl.full([BLOCK_K], 1, tl.int1)
    else:
        k_mask = offs_k < K
    return offs_k, k_mask


@triton.jit
def _skinny_step(acc, w, x_ptr, offs_k, k_mask, offs_m, m_mask, M, stride_xm,
                 BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr, INTERPRET: tl.constexpr):
    """acc += x[:, k tile] @ w_tile^T."""
    if USE_DOT:
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if x_ptr.dtype.element_ty == tl.float32:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        elif INTERPRET:  # the CPU interpreter's dot mishandles bf16; half products are exact in fp32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    else:
        w = w.to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            row = tl.minimum(m, M - 1)  # rows past M (M=3 in a block of 4) re-read the last; never stored
            x_m = tl.load(x_ptr + row * stride_xm + offs_k, mask=k_mask, other=0.0)
            part = tl.sum(w * x_m.to(tl.float32)[None, :], axis=1)
            acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    return acc


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K, k_per_split,
                   stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   USE_DOT: tl.constexpr, IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    if EVEN_N:
        n_mask = tl.full([BLOCK_N], 1, tl.int1)
    else:
        n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    k_lo = pid_k * k_per_split
    # No kernel of a forward writes W, so its first tile (at M <= 4 usually the program's whole
    # slab) is read before waiting for the previous kernel (kernels/pdl.py): the weight stream
    # starts under that kernel's tail. Everything else is read after the wait.
    offs_k, k_mask = _k_offsets(k_lo, K, BLOCK_K, EVEN_K)
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _skinny_step(acc, w, x_ptr, offs_k, k_mask, offs_m, m_mask, M, stride_xm, BLOCK_M, USE_DOT, INTERPRET)
    for k0 in range(k_lo + BLOCK_K, k_lo + k_per_split, BLOCK_K):
        offs_k, k_mask = _k_offsets(k0, K, BLOCK_K, EVEN_K)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _skinny_step(acc, w, x_ptr, offs_k, k_mask, offs_m, m_mask, M, stride_xm, BLOCK_M, USE_DOT, INTERPRET)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if IS_SPLIT:
        ws = ws_ptr + (pid_k * M + offs_m)[:, None] * N + offs_n[None, :]
        tl.store(ws, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = round_to(acc, y_ptr.dtype.element_ty, INTERPRET)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=out_mask)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, bias_ptr, y_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr):
    """y[m, n] = round(sum_s ws[s, m, n] + bias[n]) over the flat M * N outputs (y contiguous)."""
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the result does not depend on scheduling
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, round_to(acc, y_ptr.dtype.element_ty, INTERPRET), mask=mask)


def _check_config(cfg: SkinnyConfig) -> None:
    if cfg.split_k < 1:
        raise ValueError(f"config split_k must be >= 1, got {cfg.split_k}")
    for name in ("block_n", "block_k", "num_warps"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"config {name} must be a power of two, got {v}")
    if cfg.use_dot and (cfg.block_n < 16 or cfg.block_k < 16):
        raise ValueError(f"dot mode needs block_n and block_k >= 16, got {cfg.block_n}, {cfg.block_k}")


def skinny_linear(x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """F.linear(x_MK, w_NK, bias_N) for M <= 16 rows, as a new contiguous [M, N] tensor in x's dtype.

    x_MK: [M, K], any row stride (a non-unit last stride is copied). w_NK: [N, K] with a contiguous
    last dimension (any row stride). bias_N: [N] or None. All of one dtype (fp32, fp16 or bf16)
    and device. config: a SkinnyConfig to use instead of skinny_config's (benchmark sweeps).
    """
    check_float("x", x_MK)
    if x_MK.dim() != 2 or w_NK.dim() != 2:
        raise ValueError(f"x must be [M, K] and w [N, K], got {tuple(x_MK.shape)} and {tuple(w_NK.shape)}")
    (M, K), N = x_MK.shape, w_NK.shape[0]
    if M > MAX_M:
        raise ValueError(f"skinny_linear handles at most {MAX_M} rows, got M={M}: use F.linear")
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
    cfg = config if config is not None else skinny_config(M, N, K, x.element_size())
    _check_config(cfg)
    block_m = 16 if cfg.use_dot else triton.next_power_of_2(M)
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(K, k_per_split)  # rounding k_per_split up may leave trailing parts empty
    is_split = split_k > 1
    ws = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device) if is_split else y
    bias = bias_N if bias_N is not None else y  # unused when HAS_BIAS is off
    _skinny_kernel[(triton.cdiv(N, cfg.block_n), split_k)](
        x, w_NK, bias, y, ws, M, N, K, k_per_split, x.stride(0), w_NK.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot, IS_SPLIT=is_split,
        HAS_BIAS=bias_N is not None, EVEN_K=K % k_per_split == 0,
        EVEN_N=N % cfg.block_n == 0, INTERPRET=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x))
    if is_split:
        block = min(1024, triton.next_power_of_2(M * N))
        _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](
            ws, bias, y, M * N, N, SPLIT_K=split_k, HAS_BIAS=bias_N is not None, BLOCK=block,
            INTERPRET=interpreting(), num_warps=4, **pdl_launch(y))
    return y
