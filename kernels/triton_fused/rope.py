"""Rotary embedding of q and k in one launch, optionally after Qwen3's per-head RMSNorm.

Legend: T tokens, H query heads, G key heads, d head dim, P positions in the cos/sin tables,
rot = rotary_dim (<= d; dimensions rot..d-1 pass through), half = rot / 2,
BLOCK_H heads per step of a program, BLOCK_HALF = half padded to a power of two.

Maths of models/layers/rotary.py's `_rotate`: pairs (x1, x2) = (x[j], x[j + half]) (NeoX) or
(x[2j], x[2j + 1]) (interleaved) go in fp32 to (x1 cos - x2 sin, x2 cos + x1 sin), rounded to
the input dtype; cos/sin = the fp32 tables at the token's position. With the norm, x is first
models/layers/norm.py's RMSNorm of each head (see rms_norm.py), rounded to its dtype, exactly
as `rotary(q_norm(q), k_norm(k))`. Floating-point contraction (FMA) is switched off at launch so
that each product is rounded as torch rounds it.

Optionally the same launch writes the token's rotated k and its v to its paged KV-cache slot (what
kernels/triton_attention/kv_cache.py does in a launch of its own): the key program already holds
the rotated k, so a decode step saves a launch per layer. The values are those the separate write
would store: the rotated k rounded to k's dtype, then cast to the cache dtype (an FP8 cache:
quantised with k_scale / v_scale, kernels/triton_attention/kv_cache.py's to_cache_dtype).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch
from kernels.attention import is_fp8_kv
from kernels.triton_attention.kv_cache import check_kv_write, fp8_max, store_token_heads, to_cache_dtype
from kernels.triton_fused.common import (
    check_float,
    check_same_device,
    interpreting,
    round_to,
    unit_last_stride,
)


@triton.jit
def _norm_part(x, w_ptr, offs, offs_mask, rstd, in_dtype: tl.constexpr, out_dtype: tl.constexpr,
               INTERPRET: tl.constexpr):
    """weight * round(x * rstd), rounded to out_dtype, back in fp32 (what the rotation reads)."""
    normed = round_to(x * rstd[:, None], in_dtype, INTERPRET).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs_mask, other=0.0).to(tl.float32)
    return round_to(w[None, :] * normed, out_dtype, INTERPRET).to(tl.float32)


@triton.jit
def _rope_heads(x_ptr, out_ptr, w_ptr, t, cos_row_ptr, sin_row_ptr, NH, stride_t, stride_h, eps, cache_ptr,
                cache_slot, cache_scale, HEAD_DIM: tl.constexpr, ROT: tl.constexpr, NEOX: tl.constexpr,
                NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                INTERPRET: tl.constexpr, TO_CACHE: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
    """All NH heads of token t: (norm,) rotate, store to the contiguous out [T, NH, HEAD_DIM] and,
    with TO_CACHE, to cache_ptr (the token's slot: NH heads of HEAD_DIM, contiguous) unless cache_slot < 0
    (QUANT: an FP8 cache, quantised with cache_scale)."""
    HALF: tl.constexpr = ROT // 2
    in_dtype: tl.constexpr = x_ptr.dtype.element_ty
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < HALF
    if NEOX:
        o1, o2 = j, j + HALF
    else:
        o1, o2 = 2 * j, 2 * j + 1
    cos = tl.load(cos_row_ptr + j, mask=j_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_row_ptr + j, mask=j_mask, other=0.0).to(tl.float32)[None, :]
    rest = ROT + tl.arange(0, BLOCK_REST)
    rest_mask = rest < HEAD_DIM
    for h0 in range(0, NH, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        h_mask = heads < NH
        mask = h_mask[:, None] & j_mask[None, :]
        src = x_ptr + t * stride_t + heads[:, None] * stride_h
        dst = out_ptr + (t * NH + heads[:, None]) * HEAD_DIM
        x1 = tl.load(src + o1[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + o2[None, :], mask=mask, other=0.0).to(tl.float32)
        if ROT < HEAD_DIM:
            rmask = h_mask[:, None] & rest_mask[None, :]
            xr = tl.load(src + rest[None, :], mask=rmask, other=0.0)
        if NORM:
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            if ROT < HEAD_DIM:
                xr = xr.to(tl.float32)
                ss += tl.sum(xr * xr, axis=1)
            rstd = tl.rsqrt(ss / HEAD_DIM + eps)
            x1 = _norm_part(x1, w_ptr, o1, j_mask, rstd, in_dtype, out_dtype, INTERPRET)
            x2 = _norm_part(x2, w_ptr, o2, j_mask, rstd, in_dtype, out_dtype, INTERPRET)
            if ROT < HEAD_DIM:
                xr = _norm_part(xr, w_ptr, rest, rest_mask, rstd, in_dtype, out_dtype, INTERPRET)
        if ROT < HEAD_DIM:
            tl.store(dst + rest[None, :], xr.to(out_dtype), mask=rmask)  # exact: already out_dtype values
        y1 = round_to(x1 * cos - x2 * sin, out_dtype, INTERPRET)
        y2 = round_to(x2 * cos + x1 * sin, out_dtype, INTERPRET)
        tl.store(dst + o1[None, :], y1, mask=mask)
        tl.store(dst + o2[None, :], y2, mask=mask)
        if TO_CACHE:
            cache_dtype: tl.constexpr = cache_ptr.dtype.element_ty
            cdst = cache_ptr + heads[:, None] * HEAD_DIM
            ok = (tl.zeros([BLOCK_H, 1], dtype=tl.int64) + cache_slot) >= 0  # [BLOCK_H, 1]
            c1 = to_cache_dtype(y1.to(out_dtype), cache_scale, cache_dtype, QUANT, FP8_MAX, INTERPRET)
            c2 = to_cache_dtype(y2.to(out_dtype), cache_scale, cache_dtype, QUANT, FP8_MAX, INTERPRET)
            tl.store(cdst + o1[None, :], c1, mask=mask & ok)
            tl.store(cdst + o2[None, :], c2, mask=mask & ok)
            if ROT < HEAD_DIM:
                cr = to_cache_dtype(xr.to(out_dtype), cache_scale, cache_dtype, QUANT, FP8_MAX, INTERPRET)
                tl.store(cdst + rest[None, :], cr, mask=rmask & ok)


@triton.jit
def _rope_kernel(pos_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
                 H, G, stride_qt, stride_qh, stride_kt, stride_kh, eps,
                 v_ptr, stride_vt, stride_vh, kv_ptr, slot_ptr, v_offset, k_scale, v_scale,
                 HEAD_DIM: tl.constexpr, ROT: tl.constexpr, NEOX: tl.constexpr, NORM: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                 WRITE_KV: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, INTERPRET: tl.constexpr,
                 QUANT: tl.constexpr, FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (t, 0) does token t's query heads, (t, 1) its key heads (and with WRITE_KV its
    k and v to KV-cache slot slot_ptr[t]; a slot of -1 is skipped, as the separate write does)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos_row, sin_row = cos_ptr + pos * (ROT // 2), sin_ptr + pos * (ROT // 2)
    if tl.program_id(1) == 0:
        _rope_heads(q_ptr, q_out_ptr, qw_ptr, t, cos_row, sin_row, H, stride_qt, stride_qh, eps, q_out_ptr, -1,
                    k_scale, HEAD_DIM, ROT, NEOX, NORM, BLOCK_H, BLOCK_HALF, BLOCK_REST, INTERPRET, False, False,
                    FP8_MAX)
    elif WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        k_slot = kv_ptr + tl.maximum(slot, 0) * (G * HEAD_DIM)
        _rope_heads(k_ptr, k_out_ptr, kw_ptr, t, cos_row, sin_row, G, stride_kt, stride_kh, eps, k_slot, slot,
                    k_scale, HEAD_DIM, ROT, NEOX, NORM, BLOCK_H, BLOCK_HALF, BLOCK_REST, INTERPRET, True, QUANT,
                    FP8_MAX)
        if slot >= 0:
            store_token_heads(v_ptr + t * stride_vt, stride_vh, k_slot + v_offset, G, v_scale, HEAD_DIM, G_PAD,
                              D_PAD, QUANT, FP8_MAX, INTERPRET)
    else:
        _rope_heads(k_ptr, k_out_ptr, kw_ptr, t, cos_row, sin_row, G, stride_kt, stride_kh, eps, k_out_ptr, -1,
                    k_scale, HEAD_DIM, ROT, NEOX, NORM, BLOCK_H, BLOCK_HALF, BLOCK_REST, INTERPRET, False, False,
                    FP8_MAX)


def _check_qk(positions_T, q_THd, k_TGd, cos_cache, sin_cache, rotary_dim):
    if q_THd.dim() != 3 or k_TGd.dim() != 3:
        raise ValueError(f"q and k must be [T, heads, head_dim], got {tuple(q_THd.shape)} and {tuple(k_TGd.shape)}")
    T, _, d = q_THd.shape
    if k_TGd.shape[0] != T or k_TGd.shape[2] != d:
        raise ValueError(f"k {tuple(k_TGd.shape)} must have q's tokens and head dim ({T}, {d})")
    if q_THd.dtype != k_TGd.dtype:
        raise ValueError(f"q and k must have one dtype, got {q_THd.dtype} and {k_TGd.dtype}")
    check_float("q", q_THd)
    if positions_T.shape != (T,) or positions_T.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 [{T}], got {positions_T.dtype} {tuple(positions_T.shape)}")
    if not (0 < rotary_dim <= d and rotary_dim % 2 == 0):
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={d}], got {rotary_dim}")
    for name, c in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if c.dim() != 2 or c.shape[1] != rotary_dim // 2:
            raise ValueError(f"{name} must be [max_position, {rotary_dim // 2}], got {tuple(c.shape)}")
        check_float(name, c)
    check_same_device(positions=positions_T, q=q_THd, k=k_TGd, cos_cache=cos_cache, sin_cache=sin_cache)


def _check_kv_write(k, v_TGd, kv_cache_2NSGd, slot_mapping_T):
    """The optional KV-cache write's arguments: all three or none, as the separate write takes them."""
    if kv_cache_2NSGd is None:
        if v_TGd is not None or slot_mapping_T is not None:
            raise ValueError("v and slot_mapping are arguments of the KV-cache write: pass kv_cache too")
        return
    if v_TGd is None or slot_mapping_T is None:
        raise ValueError("the KV-cache write needs v and slot_mapping with kv_cache")
    check_kv_write(k, v_TGd, kv_cache_2NSGd, slot_mapping_T)
    check_same_device(k=k, v=v_TGd, kv_cache=kv_cache_2NSGd, slot_mapping=slot_mapping_T)


def _launch(positions_T, q, k, q_out, k_out, qw, kw, eps, cos_cache, sin_cache, rotary_dim, is_neox_style, norm,
            v=None, kv_cache=None, slot_mapping=None, k_scale=1.0, v_scale=1.0):
    T, H, d = q.shape
    G = k.shape[1]
    if T == 0:
        return
    write_kv = kv_cache is not None
    if not write_kv:  # unused pointers and strides
        v, kv_cache, slot_mapping = k, k_out, positions_T
    BLOCK_HALF = triton.next_power_of_2(rotary_dim // 2)
    BLOCK_REST = triton.next_power_of_2(max(d - rotary_dim, 1))
    per_head = 2 * BLOCK_HALF + (BLOCK_REST if rotary_dim < d else 0)  # elements a head keeps in registers
    budget = max(1, 4096 // per_head)
    BLOCK_H = min(triton.next_power_of_2(max(H, G)), 1 << (budget.bit_length() - 1))  # powers of two
    _rope_kernel[(T, 2)](
        positions_T, q, k, q_out, k_out, qw, kw, cos_cache.contiguous(), sin_cache.contiguous(),
        H, G, q.stride(0), q.stride(1), k.stride(0), k.stride(1), float(eps),
        v, v.stride(0), v.stride(1), kv_cache, slot_mapping, kv_cache[0].numel() if write_kv else 0,
        float(k_scale), float(v_scale),
        HEAD_DIM=d, ROT=rotary_dim, NEOX=bool(is_neox_style), NORM=norm, BLOCK_H=BLOCK_H,
        BLOCK_HALF=BLOCK_HALF, BLOCK_REST=BLOCK_REST, WRITE_KV=write_kv, G_PAD=triton.next_power_of_2(G),
        D_PAD=triton.next_power_of_2(d), INTERPRET=interpreting(),
        QUANT=write_kv and is_fp8_kv(kv_cache.dtype), FP8_MAX=fp8_max(kv_cache.dtype) if write_kv else 0.0,
        num_warps=4, enable_fp_fusion=False, **pdl_launch(q))


def rope_triton(positions_T: torch.Tensor, q_THd: torch.Tensor, k_TGd: torch.Tensor, cos_cache: torch.Tensor,
                sin_cache: torch.Tensor, rotary_dim: int, is_neox_style: bool, *, v_TGd: torch.Tensor | None = None,
                kv_cache_2NSGd: torch.Tensor | None = None, slot_mapping_T: torch.Tensor | None = None,
                k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (q, k), new contiguous tensors of q's dtype, as RotaryEmbedding.forward.

    positions_T: int32/int64 [T], each < P (not checked: no host sync). q_THd [T, H, d], k_TGd
    [T, G, d]: any strides with a contiguous last dimension (e.g. views of a fused qkv output).
    cos_cache, sin_cache: [P, rotary_dim / 2], fp32 as RotaryEmbedding builds them (other float
    dtypes are read and widened to fp32, as torch's type promotion does).
    kv_cache_2NSGd, v_TGd, slot_mapping_T (together or not at all): also write each token's rotated
    k and its v to its cache slot, as write_kv_cache_triton(k_out, v, ..., k_scale, v_scale) would
    (-1 skips a token; the scales quantise an FP8 cache, other caches ignore them).
    """
    _check_qk(positions_T, q_THd, k_TGd, cos_cache, sin_cache, rotary_dim)
    q, k = unit_last_stride(q_THd), unit_last_stride(k_TGd)
    _check_kv_write(k, v_TGd, kv_cache_2NSGd, slot_mapping_T)
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                   device=k.device)
    _launch(positions_T, q, k, q_out, k_out, q, k, 0.0, cos_cache, sin_cache, rotary_dim, is_neox_style, False,
            v_TGd, kv_cache_2NSGd, slot_mapping_T, k_scale, v_scale)
    return q_out, k_out


def qk_norm_rope_triton(positions_T: torch.Tensor, q_THd: torch.Tensor, k_TGd: torch.Tensor,
                        q_weight_d: torch.Tensor, k_weight_d: torch.Tensor, eps: float, cos_cache: torch.Tensor,
                        sin_cache: torch.Tensor, rotary_dim: int, is_neox_style: bool, *,
                        v_TGd: torch.Tensor | None = None, kv_cache_2NSGd: torch.Tensor | None = None,
                        slot_mapping_T: torch.Tensor | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """rope(RMSNorm_q(q), RMSNorm_k(k)) in one launch (Qwen3 attention): each head normalised
    over d with its weight, then rotated. Output dtype: promote(q dtype, weight dtype), as the
    unfused composition gives. Arguments as rope_triton (the KV-cache write too), plus the [d]
    norm weights and eps."""
    _check_qk(positions_T, q_THd, k_TGd, cos_cache, sin_cache, rotary_dim)
    d = q_THd.shape[2]
    for name, w in (("q_weight", q_weight_d), ("k_weight", k_weight_d)):
        check_float(name, w)
        if w.shape != (d,):
            raise ValueError(f"{name} must be [{d}] (the head dim), got {tuple(w.shape)}")
    check_same_device(q=q_THd, q_weight=q_weight_d, k_weight=k_weight_d)
    q, k = unit_last_stride(q_THd), unit_last_stride(k_TGd)
    _check_kv_write(k, v_TGd, kv_cache_2NSGd, slot_mapping_T)
    q_dtype = torch.promote_types(q.dtype, q_weight_d.dtype)
    k_dtype = torch.promote_types(k.dtype, k_weight_d.dtype)
    q_out = torch.empty(q.shape, dtype=q_dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k_dtype, device=k.device)
    _launch(positions_T, q, k, q_out, k_out, q_weight_d.contiguous(), k_weight_d.contiguous(), eps,
            cos_cache, sin_cache, rotary_dim, is_neox_style, True, v_TGd, kv_cache_2NSGd, slot_mapping_T,
            k_scale, v_scale)
    return q_out, k_out
