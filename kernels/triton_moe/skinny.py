"""The expert layer for a handful of tokens (decode at batch 1-2): two launches, no alignment.

Legend: T tokens, D hidden, F expert intermediate, K top-k, R = T*K flat rows (t, k).

At a few rows the grouped GEMM's machinery costs more than it saves: alignment sorts and pads the
rows (a launch), each expert's one row is padded to BLOCK_M tensor-core rows, and the top-k sum is
another launch. Like the skinny dense GEMM (kernels/triton_fused/skinny_gemm.py), the whole cost
at this size is streaming the touched experts' weights once, so each program owns a few output
columns of one row and reduces [BLOCK_N, BLOCK_K] weight tiles against the row in fp32 registers:

gate_up:  h_RF[r] = SiLU(x[t] @ gate_e^T) * (x[t] @ up_e^T)       e = ids[t, k], grid (R, F / BLOCK_N)
down:     out_TD[t] = sum_k w[t, k] * (h_RF[(t, k)] @ w2_e^T)     grid (T, D / BLOCK_N)

The down program walks its token's K experts in order, so the top-k sum is fused, in fp32, in a
fixed order (deterministic, no atomics), and rounded once. Rows whose expert lives on another
rank (-1 after `expert_map`) are skipped by both kernels. No host sync and buffers sized from
shapes only: capturable in a CUDA graph.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton_fused.common import interpreting, round_to

# The most tokens this path takes (the grouped GEMM above: it reuses a weight tile over the rows
# of an expert). MOE_SKINNY_EXPERTS=0 turns the path off (A/B runs).
SKINNY_MAX_TOKENS = 2 if os.environ.get("MOE_SKINNY_EXPERTS", "1") != "0" else 0


class SkinnyExpertConfig(NamedTuple):
    up_block_n: int     # F columns per gate_up program (of gate and of up each)
    up_block_k: int     # D chunk per step
    down_block_n: int   # D columns per down program
    down_block_k: int   # F chunk per step
    num_warps: int = 4


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def skinny_expert_config(D: int, F: int, elem_bytes: int = 2) -> SkinnyExpertConfig:
    """Tiles of ~8 KiB of weights per step (gate_up loads two: gate and up) with whole rows of up
    to 4 KiB per step, so every load is issued up front and occupancy hides the HBM latency."""
    tile = 8192
    up_k = min(triton.next_power_of_2(D), 4096 // elem_bytes)
    up_n = max(1, min(_pow2_floor(tile // (2 * up_k * elem_bytes)), triton.next_power_of_2(F)))
    down_k = min(triton.next_power_of_2(F), 2048 // elem_bytes)
    down_n = max(1, min(_pow2_floor(tile // (down_k * elem_bytes)), triton.next_power_of_2(D)))
    return SkinnyExpertConfig(up_n, up_k, down_n, down_k)


@triton.jit
def _local_expert(ids_ptr, map_ptr, r, HAS_MAP: tl.constexpr):
    e = tl.load(ids_ptr + r).to(tl.int64)
    if HAS_MAP:
        e = tl.load(map_ptr + e).to(tl.int64)
    return e


@triton.jit(do_not_specialize=["R"])
def _gate_up_rows_kernel(x_ptr, w_ptr, ids_ptr, map_ptr, h_ptr, R, F, D, top_k,
                         stride_xt, stride_we, stride_wn, stride_hr,
                         HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    r = tl.program_id(0)
    e = _local_expert(ids_ptr, map_ptr, r, HAS_MAP)
    if e >= 0:
        t = (r // top_k).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        if EVEN_N:  # constant-true masks keep the 16-byte loads vectorised
            n_mask = tl.full([BLOCK_N], 1, tl.int1)
        else:
            n_mask = offs_n < F
        g_rows = w_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        u_rows = g_rows + F * stride_wn
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                k_mask = tl.full([BLOCK_K], 1, tl.int1)
            else:
                k_mask = offs_k < D
            x = tl.load(x_ptr + t * stride_xt + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            w_mask = n_mask[:, None] & k_mask[None, :]
            g = tl.load(g_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)
            u = tl.load(u_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)
            acc_g += tl.sum(g * x[None, :], axis=1)
            acc_u += tl.sum(u * x[None, :], axis=1)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_ptr + r.to(tl.int64) * stride_hr + offs_n, round_to(h, h_ptr.dtype.element_ty, INTERPRET),
                 mask=n_mask)


@triton.jit(do_not_specialize=["T"])
def _down_sum_rows_kernel(h_ptr, w_ptr, ids_ptr, map_ptr, tw_ptr, out_ptr, T, D, F,
                          stride_hr, stride_we, stride_wn, stride_ot,
                          K: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                          INTERPRET: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        n_mask = tl.full([BLOCK_N], 1, tl.int1)
    else:
        n_mask = offs_n < D
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(K):  # fixed order: the sum does not depend on scheduling
        r = t * K + k
        e = _local_expert(ids_ptr, map_ptr, r, HAS_MAP)
        if e >= 0:
            w_rows = w_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
            part = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, F, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                if EVEN_K:
                    k_mask = tl.full([BLOCK_K], 1, tl.int1)
                else:
                    k_mask = offs_k < F
                h = tl.load(h_ptr + r * stride_hr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
                w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                part += tl.sum(w.to(tl.float32) * h[None, :], axis=1)
            acc += tl.load(tw_ptr + r).to(tl.float32) * part
    tl.store(out_ptr + t * stride_ot + offs_n, round_to(acc, out_ptr.dtype.element_ty, INTERPRET), mask=n_mask)


def fused_experts_skinny(x_TD: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor,
                         topk_weights_TK: torch.Tensor, topk_ids_TK: torch.Tensor,
                         expert_map_E: torch.Tensor | None = None,
                         config: SkinnyExpertConfig | None = None) -> torch.Tensor:
    """The expert layer of kernels.fused_experts (same contract, unquantised weights) for a few
    tokens; any T works, but past SKINNY_MAX_TOKENS the grouped GEMM is faster.

    x_TD, w13_EFD [E, 2F, D] and w2_EDF [E, D, F] of one float dtype with contiguous last
    dimensions; topk_weights_TK float, topk_ids_TK int (global ids when expert_map_E is given).
    """
    T, D = x_TD.shape
    F = w2_EDF.shape[2]
    K = topk_ids_TK.shape[1]
    out = torch.empty(T, D, dtype=x_TD.dtype, device=x_TD.device)
    if T == 0:
        return out
    for name, t in (("hidden_states", x_TD), ("w13", w13_EFD), ("w2", w2_EDF)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    cfg = config if config is not None else skinny_expert_config(D, F, x_TD.element_size())
    ids = topk_ids_TK.contiguous()
    weights = topk_weights_TK.contiguous()
    emap = expert_map_E if expert_map_E is not None else ids  # unused when HAS_MAP is off
    h = torch.empty(T * K, F, dtype=x_TD.dtype, device=x_TD.device)
    interp = interpreting()
    _gate_up_rows_kernel[(T * K, triton.cdiv(F, cfg.up_block_n))](
        x_TD, w13_EFD, ids, emap, h, T * K, F, D, K,
        x_TD.stride(0), w13_EFD.stride(0), w13_EFD.stride(1), h.stride(0),
        HAS_MAP=expert_map_E is not None, BLOCK_N=cfg.up_block_n, BLOCK_K=cfg.up_block_k,
        EVEN_N=F % cfg.up_block_n == 0, EVEN_K=D % cfg.up_block_k == 0, INTERPRET=interp,
        num_warps=cfg.num_warps)
    _down_sum_rows_kernel[(T, triton.cdiv(D, cfg.down_block_n))](
        h, w2_EDF, ids, emap, weights, out, T, D, F,
        h.stride(0), w2_EDF.stride(0), w2_EDF.stride(1), out.stride(0),
        K=K, HAS_MAP=expert_map_E is not None, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k,
        EVEN_N=D % cfg.down_block_n == 0, EVEN_K=F % cfg.down_block_k == 0, INTERPRET=interp,
        num_warps=cfg.num_warps)
    return out
