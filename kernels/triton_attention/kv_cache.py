"""KV-cache write: each new token's K and V go to its cache slot in one launch.
Reference: kernels.attention.write_kv_cache.

Legend: T tokens, G KV heads, d head dim, N cache blocks, S block size.
kv_cache_2NSGd = [2 (k, v), N, S, G, d] contiguous; slot = block_id * S + offset, so a slot's
G*d values are contiguous at slot * G * d. Slot -1 skips the token (padded rows of a CUDA graph).
An FP8 cache (float8_e4m3fn / float8_e5m2) stores fp8(clamp(x / scale)) with the layer's k_scale /
v_scale (kernels/attention.py's quantize_kv; IEEE division, round to nearest even, saturated).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.attention import is_fp8_kv
from kernels.pdl import pdl_enter, pdl_launch


def fp8_max(dtype: torch.dtype) -> float:
    """The saturation bound of an FP8 cache dtype (0.0, unused, for the others)."""
    return float(torch.finfo(dtype).max) if is_fp8_kv(dtype) else 0.0


def quant_interpreted(dtype: torch.dtype) -> bool:
    """to_cache_dtype's INTERPRET: an FP8 cache written under the CPU interpreter (False on the
    GPU, and for other caches, whose kernels then compile exactly as without FP8 support)."""
    return is_fp8_kv(dtype) and os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _fp8_grid(x, MANT_DROP: tl.constexpr, SUB_MAGIC: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """fp32 x (within the FP8 range) rounded to nearest-even onto the FP8 grid, still fp32: normal
    values keep 23 - MANT_DROP mantissa bits (half an ulp added on the bits, ties to even, the
    carry running into the exponent), subnormal ones (|x| < MIN_NORMAL) snap to the fixed step
    by adding and subtracting SUB_MAGIC (whose fp32 ulp is that step); the sign is kept, -0 too."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + ((1 << (MANT_DROP - 1)) - 1) + ((bits >> MANT_DROP) & 1)
    normal = ((bits >> MANT_DROP) << MANT_DROP).to(tl.float32, bitcast=True)
    sub = (tl.abs(x) + SUB_MAGIC) - SUB_MAGIC
    sub = (sub.to(tl.uint32, bitcast=True) | (x.to(tl.uint32, bitcast=True) & 0x80000000)).to(tl.float32,
                                                                                                bitcast=True)
    return tl.where(tl.abs(x) < MIN_NORMAL, sub, normal)


@triton.jit
def to_cache_dtype(x, scale, cache_dtype: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """x as the cache stores it: with QUANT (an FP8 cache) fp8(clamp(x / scale, +-FP8_MAX)) computed
    in fp32 (IEEE division; the cast rounds to nearest-even), else a plain cast.

    The CPU interpreter (triton 3.9) casts fp32 -> fp8 wrongly where rounding carries into the
    exponent (tests/kernels/fp8_interpreter_cast.py), so there the value is first rounded onto the
    FP8 grid by hand and the cast that follows is exact; the GPU's cast rounds by itself."""
    if QUANT:
        x = tl.math.div_rn(x.to(tl.float32), scale)
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
        if INTERPRET:
            if cache_dtype == tl.float8e5:
                x = _fp8_grid(x, 21, 128.0, 6.103515625e-05)  # 2 mantissa bits, 2^-16 steps below 2^-14
            else:
                x = _fp8_grid(x, 20, 16384.0, 0.015625)  # e4m3: 3 mantissa bits, 2^-9 steps below 2^-6
    return x.to(cache_dtype)


@triton.jit
def store_token_heads(src_ptr, stride_g, dst_ptr, G, scale, HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr,
                      D_PAD: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr, INTERPRET: tl.constexpr):
    """One token's G heads of HEAD_DIM values (rows stride_g apart, unit stride along d) to dst_ptr
    (G * HEAD_DIM contiguous: a cache slot), cast to dst's dtype (QUANT: FP8, quantised with
    `scale`, see to_cache_dtype). Also used by the RoPE kernel (kernels/triton_fused/rope.py),
    which writes v to the cache in its own launch."""
    g = tl.arange(0, G_PAD)
    dd = tl.arange(0, D_PAD)
    mask = (g[:, None] < G) & (dd[None, :] < HEAD_DIM)
    x = tl.load(src_ptr + g[:, None] * stride_g + dd[None, :], mask=mask)
    y = to_cache_dtype(x, scale, dst_ptr.dtype.element_ty, QUANT, FP8_MAX, INTERPRET)
    tl.store(dst_ptr + g[:, None] * HEAD_DIM + dd[None, :], y, mask=mask)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kv_ptr, slot_ptr, stride_kt, stride_kg, stride_vt, stride_vg,
                     v_offset, k_scale, v_scale, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                     G_PAD: tl.constexpr, D_PAD: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
                     INTERPRET: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    t64 = t.to(tl.int64)
    dst = kv_ptr + slot * (G * HEAD_DIM)
    store_token_heads(k_ptr + t64 * stride_kt, stride_kg, dst, G, k_scale, HEAD_DIM, G_PAD, D_PAD, QUANT, FP8_MAX,
                      INTERPRET)
    store_token_heads(v_ptr + t64 * stride_vt, stride_vg, dst + v_offset, G, v_scale, HEAD_DIM, G_PAD, D_PAD,
                      QUANT, FP8_MAX, INTERPRET)


def check_kv_write(k_TGd: torch.Tensor, v_TGd: torch.Tensor, kv_cache_2NSGd: torch.Tensor,
                   slot_mapping_T: torch.Tensor) -> None:
    """The arguments of a KV-cache write (here, or fused into the RoPE launch): a contiguous
    [2, N, S, G, d] cache, k and v [T, G, d] with unit stride along d, T int32/int64 slots."""
    if kv_cache_2NSGd.dim() != 5 or kv_cache_2NSGd.shape[0] != 2 or not kv_cache_2NSGd.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous [2, N, S, G, d] (kv_cache_2NSGd), got "
                         f"{tuple(kv_cache_2NSGd.shape)}")
    _, N, S, G, d = kv_cache_2NSGd.shape
    T = k_TGd.shape[0] if k_TGd.dim() == 3 else -1
    for name, arg, x in (("k", "k_TGd", k_TGd), ("v", "v_TGd", v_TGd)):
        if x.dim() != 3 or x.shape != (T, G, d) or x.stride(2) != 1:
            raise ValueError(f"{name} must be [T, G={G}, d={d}] with unit stride along d ({arg}; T as k's), got "
                             f"{tuple(x.shape)} strides {x.stride()}")
    if slot_mapping_T.shape != (T,) or slot_mapping_T.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [T={T}] (slot_mapping_T), got "
                         f"{slot_mapping_T.dtype} {tuple(slot_mapping_T.shape)}")


def write_kv_cache_triton(k_TGd: torch.Tensor, v_TGd: torch.Tensor, kv_cache_2NSGd: torch.Tensor,
                          slot_mapping_T: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Writes k_TGd[t] / v_TGd[t] to slot slot_mapping_T[t] of the K / V cache; -1 = skip.

    k_TGd, v_TGd: [T, G, d] with any strides along T and G but unit stride along d (views split
    from a fused qkv output are fine). Cast to the cache dtype; an FP8 cache is quantised with
    k_scale / v_scale (host floats, fixed per layer: a captured graph keeps them). slot_mapping_T:
    [T] int32/int64.
    """
    check_kv_write(k_TGd, v_TGd, kv_cache_2NSGd, slot_mapping_T)
    _, N, S, G, d = kv_cache_2NSGd.shape
    T = k_TGd.shape[0]
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k_TGd, v_TGd, kv_cache_2NSGd, slot_mapping_T, k_TGd.stride(0), k_TGd.stride(1),
        v_TGd.stride(0), v_TGd.stride(1), N * S * G * d, float(k_scale), float(v_scale), G=G, HEAD_DIM=d,
        G_PAD=triton.next_power_of_2(G), D_PAD=triton.next_power_of_2(d), QUANT=is_fp8_kv(kv_cache_2NSGd.dtype),
        FP8_MAX=fp8_max(kv_cache_2NSGd.dtype), INTERPRET=quant_interpreted(kv_cache_2NSGd.dtype), num_warps=4,
        **pdl_launch(k_TGd))
