"""Softmax top-k router in one launch: routing/router.py's softmax_topk; and, for decode batches,
the gate GEMM with it in the same launch (gate_softmax_topk_triton).

Legend: T tokens, D hidden, E experts (<= 512), K top-k (<= 16), BLOCK_T token rows per program,
BLOCK_E = E padded to a power of two, BLOCK_K = K padded to a power of two.

Per row: softmax over the E logits in fp32 (exp(x - max) / sum), then K passes of "take the
maximum, then mask it out" in registers, so weights come out in descending order; among equal
probabilities the lowest expert id is taken first (torch.topk leaves that order unspecified).
With renormalize the K weights are divided by their sum.

With the gate (decode batches, up to GATE_MAX_TOKENS tokens): the gate GEMM runs as the skinny
GEMM does (skinny_gemm.py: rows mode for <= 4 tokens, 16-row tl.dot tiles above; no split-K),
each program storing its logits columns rounded to x's dtype (as the GEMM's output would be) in
an fp32 workspace; the last program of each token tile to finish (kernels/last_program.py)
routes the tile's rows. That saves the router's launch and the gap before it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.last_program import zeroed_counters
from kernels.pdl import pdl_enter, pdl_launch
from kernels.triton_fused.common import check_float, check_same_device, interpreting, round_to, unit_last_stride
from kernels.triton_fused.skinny_gemm import _k_offsets, _skinny_step, skinny_config

MAX_EXPERTS = 512
MAX_TOP_K = 16


# The row count changes with the batch: not specialised on, so every batch size shares one
# compiled kernel (no compile while a CUDA graph of a new size is captured).
@triton.jit(do_not_specialize=["T"])
def _softmax_topk_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_t,
                         K: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    mask = (rows < T)[:, None] & (cols < E)[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)
    _route_rows(x.to(tl.float32), rows, T, E, w_ptr, ids_ptr, K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K)


@triton.jit
def _route_rows(x, rows, T, E, w_ptr, ids_ptr, K: tl.constexpr, RENORMALIZE: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Softmax top-k of the fp32 logits x [BLOCK_T, BLOCK_E] of rows `rows`, stored to w / ids."""
    row_mask = rows < T
    cols = tl.arange(0, BLOCK_E)
    col_mask = cols < E
    x = tl.where(col_mask[None, :], x, float("-inf"))  # rows past T read zeros: finite, never stored
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = e / tl.sum(e, axis=1)[:, None]
    p = tl.where(col_mask[None, :], p, -1.0)  # padding below every probability
    kcols = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(K):
        best = tl.max(p, axis=1)
        # lowest index holding the maximum: explicit, so ties do not depend on argmax's rule
        idx = tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1)
        weights = tl.where(kcols[None, :] == k, best[:, None], weights)
        ids = tl.where(kcols[None, :] == k, idx[:, None], ids)
        p = tl.where(cols[None, :] == idx[:, None], -2.0, p)  # taken: below padding and every probability
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]  # columns >= K hold 0
    out_mask = row_mask[:, None] & (kcols < K)[None, :]
    offs = rows[:, None] * K + kcols[None, :]
    tl.store(w_ptr + offs, weights, mask=out_mask)
    tl.store(ids_ptr + offs, ids, mask=out_mask)


def softmax_topk_triton(logits_TE: torch.Tensor, top_k: int, renormalize: bool,
                        out_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights_TK fp32, ids_TK int32) of the top_k softmax probabilities of each row, descending.

    logits_TE: [T, E] fp32/fp16/bf16, any row stride; E <= 512, top_k <= min(E, 16).
    out_ids: a contiguous [T, top_k] int32 tensor to write the ids into (the expert-load
    counters' step buffer); a new one when None.
    """
    check_float("logits", logits_TE)
    if logits_TE.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits_TE.shape)}")
    T, E = logits_TE.shape
    if not 0 < E <= MAX_EXPERTS:
        raise ValueError(f"softmax_topk_triton handles 1..{MAX_EXPERTS} experts, got {E}")
    if not 0 < top_k <= min(E, MAX_TOP_K):
        raise ValueError(f"top_k must be in 1..{min(E, MAX_TOP_K)} (E={E}, at most {MAX_TOP_K}), got {top_k}")
    logits = unit_last_stride(logits_TE)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device) if out_ids is None else out_ids
    if T > 0:
        BLOCK_E = triton.next_power_of_2(E)
        BLOCK_T = max(1, min(8, 1024 // BLOCK_E))
        _softmax_topk_kernel[(triton.cdiv(T, BLOCK_T),)](
            logits, weights, ids, T, E, logits.stride(0), K=top_k, RENORMALIZE=bool(renormalize),
            BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_K=triton.next_power_of_2(top_k), num_warps=4, **pdl_launch(logits))
    return weights, ids


@triton.jit(do_not_specialize=["T"])
def _gate_softmax_topk_kernel(x_ptr, g_ptr, logits_ptr, counter_ptr, w_ptr, ids_ptr, T, E, D, stride_xt, stride_ge,
                              K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                              USE_DOT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                              INTERPRET: tl.constexpr, USE_PDL: tl.constexpr):
    pid_t = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < E
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    g_rows = g_ptr + offs_n.to(tl.int64)[:, None] * stride_ge
    # the gate's first tile is read before the wait, as the skinny GEMM does (weights: never written)
    offs_d, d_mask = _k_offsets(0, D, BLOCK_D, EVEN_D)
    g = tl.load(g_rows + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    acc = _skinny_step(acc, g, x_ptr, offs_d, d_mask, offs_t, t_mask, T, stride_xt, BLOCK_T, USE_DOT, INTERPRET)
    for d0 in range(BLOCK_D, D, BLOCK_D):
        offs_d, d_mask = _k_offsets(d0, D, BLOCK_D, EVEN_D)
        g = tl.load(g_rows + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = _skinny_step(acc, g, x_ptr, offs_d, d_mask, offs_t, t_mask, T, stride_xt, BLOCK_T, USE_DOT, INTERPRET)
    logits = round_to(acc, x_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
    tl.store(logits_ptr + offs_t[:, None] * E + offs_n[None, :], logits, mask=t_mask[:, None] & n_mask[None, :])
    tl.debug_barrier()  # every thread's logits are stored before the count says so
    if tl.atomic_add(counter_ptr + pid_t, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        rows = offs_t.to(tl.int64)
        cols = tl.arange(0, BLOCK_E)
        mask = t_mask[:, None] & (cols < E)[None, :]
        x = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        _route_rows(x, rows, T, E, w_ptr, ids_ptr, K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K)
        tl.atomic_xchg(counter_ptr + pid_t, 0)  # ready for the next launch


# Up to this many tokens the gate GEMM and the router run as one launch (softmax_topk_gate):
# the decode graphs' sizes, where the two launches and the gap between them cost more than the
# GEMM (BENCHMARKS.md §3). A prefill step keeps cuBLAS's GEMM and the separate router.
GATE_MAX_TOKENS = 256
_GATE_ROWS_MODE_TOKENS = 4  # the skinny GEMM's rows mode; 16-row tl.dot tiles above
_GATE_TILE_TOKENS = 16


def gate_softmax_topk_triton(x_TD: torch.Tensor, gate_ED: torch.Tensor, top_k: int, renormalize: bool,
                             out_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_topk_triton(x_TD @ gate_ED.T) in one launch, for at most GATE_MAX_TOKENS tokens.

    The grid is (column blocks of the gate) x (tiles of 16 tokens; one tile of T <= 4): each
    program computes its logits columns for its tile's tokens as the skinny GEMM does, stores
    them rounded to x's dtype (as the gate GEMM's output would be) in an fp32 workspace, and the
    last program of each tile to finish (kernels/last_program.py) routes the tile's rows.

    x_TD: [T, D] fp32/fp16/bf16 (any row stride); gate_ED: [E, D] of x's dtype with a contiguous
    last dimension, E <= 512. Returns (weights_TK fp32, ids_TK int32); out_ids as in
    softmax_topk_triton.
    """
    check_float("x", x_TD)
    if x_TD.dim() != 2 or gate_ED.dim() != 2 or gate_ED.shape[1] != x_TD.shape[1]:
        raise ValueError(f"x must be [T, D] and the gate [E, D], got {tuple(x_TD.shape)} and {tuple(gate_ED.shape)}")
    if gate_ED.dtype != x_TD.dtype or gate_ED.stride(1) != 1:
        raise ValueError(f"the gate must be {x_TD.dtype} with a contiguous last dimension")
    check_same_device(x=x_TD, gate=gate_ED)
    (T, D), E = x_TD.shape, gate_ED.shape[0]
    if not 0 < T <= GATE_MAX_TOKENS:
        raise ValueError(f"gate_softmax_topk_triton handles 1..{GATE_MAX_TOKENS} tokens, got {T}")
    if not 0 < E <= MAX_EXPERTS:
        raise ValueError(f"gate_softmax_topk_triton handles 1..{MAX_EXPERTS} experts, got {E}")
    if not 0 < top_k <= min(E, MAX_TOP_K):
        raise ValueError(f"top_k must be in 1..{min(E, MAX_TOP_K)} (E={E}, at most {MAX_TOP_K}), got {top_k}")
    x = unit_last_stride(x_TD)
    dev = x.device
    rows_mode = T <= _GATE_ROWS_MODE_TOKENS
    block_t = triton.next_power_of_2(T) if rows_mode else _GATE_TILE_TOKENS
    cfg = skinny_config(min(T, _GATE_TILE_TOKENS), E, D, x.element_size())  # no split-K: the last program routes
    n_tiles = triton.cdiv(T, block_t)
    logits = torch.empty(T, E, dtype=torch.float32, device=dev)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=dev) if out_ids is None else out_ids
    _gate_softmax_topk_kernel[(triton.cdiv(E, cfg.block_n), n_tiles)](
        x, gate_ED, logits, zeroed_counters("gate_router", n_tiles, dev), weights, ids, T, E, D, x.stride(0),
        gate_ED.stride(0), K=top_k, RENORMALIZE=bool(renormalize), BLOCK_T=block_t,
        BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_k, EVEN_D=D % cfg.block_k == 0, USE_DOT=not rows_mode,
        BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k), INTERPRET=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x))
    return weights, ids
