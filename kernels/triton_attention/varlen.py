"""Flash attention over contiguous variable-length K/V (no paging), bottom-right causal.

Sequence b's queries are rows cu_q[b] .. cu_q[b+1]-1 of q, its keys / values rows
cu_k[b] .. cu_k[b+1]-1 of k / v. The queries sit at the END of their context: with n_b queries
and Lk_b keys, query i is at position Lk_b - n_b + i and sees keys 0 .. Lk_b - n_b + i (so
Lk_b >= n_b). Used by the MLA prefill in the expanded form, where the keys are per-head
[k_nope | k_pe] (E = Dn + P = 192 for DeepSeek-V3) and the values Dv (128) wide.

The qk head dim is split into a power-of-two part EA and a remainder EB padded to a power of
two (192 = 128 + 64 needs no padding), the v head dim is padded to a power of two; padding is
masked. One launch covers the batch: grid (query tiles of the longest query, B, H); tiles past
a sequence's own queries return at once.

Reference: torch scaled_dot_product_attention per sequence (kernels/mla_attention.py's
`mla_expanded_prefill_torch` is this attention after the kv_b_proj expansion).

Legend: T query rows (all sequences), L key rows (all sequences), H heads, E qk head dim,
Dv v head dim, B sequences.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the CPU interpreter computes bf16 dots wrongly; fp32 is exact there
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _varlen_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr,
    E, Dv, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EA: tl.constexpr, EB: tl.constexpr, HAS_B: tl.constexpr,
    DV_PAD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    m_tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q0 = tl.load(cu_q_ptr + b).to(tl.int64)
    n = tl.load(cu_q_ptr + b + 1).to(tl.int64) - q0
    if m_tile * BLOCK_M >= n:
        return
    k0 = tl.load(cu_k_ptr + b).to(tl.int64)
    Lk = tl.load(cu_k_ptr + b + 1).to(tl.int64) - k0
    first_pos = Lk - n  # position of query 0

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < n
    offs_a = tl.arange(0, EA)
    offs_b = tl.arange(0, EB)
    offs_v = tl.arange(0, DV_PAD)
    a_mask = offs_a < E
    b_mask = offs_b < E - EA
    v_mask = offs_v < Dv

    q_rows = q_ptr + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh
    qa = tl.load(q_rows + offs_a[None, :], mask=m_mask[:, None] & a_mask[None, :], other=0.0)
    if HAS_B:
        qb = tl.load(q_rows + EA + offs_b[None, :], mask=m_mask[:, None] & b_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    # Every row (padded ones too) sees key 0 in the first tile, so m_i is finite after it.
    # keys past the last query of this tile are never seen
    hi = tl.minimum(Lk, first_pos + tl.minimum((m_tile + 1) * BLOCK_M, n))
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        k_rows = k_ptr + (k0 + offs_n)[:, None] * stride_kt + h * stride_kh
        ka = tl.load(k_rows + offs_a[None, :], mask=n_mask[:, None] & a_mask[None, :], other=0.0).to(qa.dtype)
        s = _dot(qa, tl.trans(ka), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), PRECISION, UPCAST)
        if HAS_B:
            kb = tl.load(k_rows + EA + offs_b[None, :], mask=n_mask[:, None] & b_mask[None, :], other=0.0)
            s = _dot(qb, tl.trans(kb.to(qa.dtype)), s, PRECISION, UPCAST)
        s = s * qk_scale
        visible = n_mask[None, :] & (offs_n[None, :] <= first_pos + offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (k0 + offs_n)[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
                    mask=n_mask[:, None] & v_mask[None, :], other=0.0).to(qa.dtype)
        acc = _dot(p.to(qa.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o = o_ptr + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_v[None, :]
    tl.store(o, acc.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & v_mask[None, :])


def _split_head_dim(E: int) -> tuple[int, int]:
    """(EA, EB): EA the largest power of two <= E (at least 16), EB the rest padded to a power
    of two (0 when nothing is left; the kernel then gets a dummy EB and HAS_B False)."""
    ea = max(16, 1 << (E.bit_length() - 1))
    rest = E - ea
    return ea, (max(16, triton.next_power_of_2(rest)) if rest > 0 else 0)



def varlen_attention_triton(q_THE: torch.Tensor, k_LHE: torch.Tensor, v_LHDv: torch.Tensor,
                            cu_seqlens_q_B1: torch.Tensor, cu_seqlens_k_B1: torch.Tensor, max_query_len: int,
                            scale: float, out_THDv: torch.Tensor | None = None) -> torch.Tensor:
    """Bottom-right causal attention of each sequence's queries over its own keys (see the
    module docstring). q/k/v may be strided views (last dim contiguous); returns out_THDv in
    q's dtype unless `out_THDv` is given. Softmax in fp32. Requires Lk_b >= n_b."""
    if q_THE.dim() != 3 or k_LHE.dim() != 3 or v_LHDv.dim() != 3:
        raise ValueError("q, k, v must be [rows, heads, head_dim]")
    T, H, E = q_THE.shape
    L, Dv = k_LHE.shape[0], v_LHDv.shape[2]
    if k_LHE.shape[1:] != (H, E) or v_LHDv.shape[:2] != (L, H):
        raise ValueError(f"shapes do not match: q {tuple(q_THE.shape)}, k {tuple(k_LHE.shape)}, "
                         f"v {tuple(v_LHDv.shape)} (same heads for all, k's head dim = q's)")
    if cu_seqlens_q_B1.dim() != 1 or cu_seqlens_q_B1.shape != cu_seqlens_k_B1.shape or cu_seqlens_q_B1.numel() < 1:
        raise ValueError(f"cu_seqlens must both be [B + 1]: {tuple(cu_seqlens_q_B1.shape)}, "
                         f"{tuple(cu_seqlens_k_B1.shape)}")
    if any(t.stride(2) != 1 for t in (q_THE, k_LHE, v_LHDv)):
        raise ValueError("q, k and v must be contiguous in their last dim")
    if out_THDv is None:
        out_THDv = q_THE.new_empty(T, H, Dv)
    elif out_THDv.shape != (T, H, Dv) or out_THDv.stride(2) != 1:
        raise ValueError(f"out must be [T, H, Dv] = {(T, H, Dv)} with a contiguous last dim")
    B = cu_seqlens_q_B1.numel() - 1
    if B == 0 or T == 0 or max_query_len <= 0:
        return out_THDv
    EA, EB = _split_head_dim(E)
    DV_PAD = max(16, triton.next_power_of_2(Dv))
    block_m = 64 if max_query_len > 32 else 32 if max_query_len > 16 else 16
    block_n = 64 if EA + EB <= 256 and DV_PAD <= 128 else 32
    upcast = os.environ.get("TRITON_INTERPRET") == "1" and q_THE.dtype != torch.float32
    grid = (triton.cdiv(max_query_len, block_m), B, H)
    _varlen_fwd_kernel[grid](
        q_THE, k_LHE, v_LHDv, out_THDv, cu_seqlens_q_B1, cu_seqlens_k_B1, E, Dv, scale * _LOG2E,
        q_THE.stride(0), q_THE.stride(1), k_LHE.stride(0), k_LHE.stride(1), v_LHDv.stride(0), v_LHDv.stride(1),
        out_THDv.stride(0), out_THDv.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, EA=EA, EB=max(EB, 16), HAS_B=EB > 0, DV_PAD=DV_PAD,
        PRECISION="ieee" if q_THE.dtype == torch.float32 else "tf32", UPCAST=upcast,
        num_warps=4 if block_m <= 32 else 8, num_stages=2)
    return out_THDv
