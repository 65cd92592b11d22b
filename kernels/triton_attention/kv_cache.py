"""KV-cache write: each new token's K and V go to its cache slot in one launch.
Reference: kernels.attention.write_kv_cache.

Legend: T tokens, G KV heads, d head dim, N cache blocks, S block size.
kv_cache_2NSGd = [2 (k, v), N, S, G, d] contiguous; slot = block_id * S + offset, so a slot's
G*d values are contiguous at slot * G * d. Slot -1 skips the token (padded rows of a CUDA graph).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kv_ptr, slot_ptr, stride_kt, stride_kg, stride_vt, stride_vg,
                     v_offset, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                     G_PAD: tl.constexpr, D_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    g = tl.arange(0, G_PAD)
    dd = tl.arange(0, D_PAD)
    mask = (g[:, None] < G) & (dd[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + g[:, None] * stride_kg + dd[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + g[:, None] * stride_vg + dd[None, :], mask=mask)
    dst = kv_ptr + slot * (G * HEAD_DIM) + g[:, None] * HEAD_DIM + dd[None, :]
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + v_offset, v.to(kv_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(k_TGd: torch.Tensor, v_TGd: torch.Tensor, kv_cache_2NSGd: torch.Tensor,
                          slot_mapping_T: torch.Tensor) -> None:
    """Writes k_TGd[t] / v_TGd[t] to slot slot_mapping_T[t] of the K / V cache; -1 = skip.

    k_TGd, v_TGd: [T, G, d] with any strides along T and G but unit stride along d (views split
    from a fused qkv output are fine). Cast to the cache dtype. slot_mapping_T: [T] int32/int64.
    """
    if kv_cache_2NSGd.dim() != 5 or kv_cache_2NSGd.shape[0] != 2 or not kv_cache_2NSGd.is_contiguous():
        raise ValueError(f"kv_cache_2NSGd must be a contiguous [2, N, S, G, d], got {tuple(kv_cache_2NSGd.shape)}")
    _, N, S, G, d = kv_cache_2NSGd.shape
    for name, x in (("k_TGd", k_TGd), ("v_TGd", v_TGd)):
        if x.dim() != 3 or x.shape[1:] != (G, d) or x.stride(2) != 1:
            raise ValueError(f"{name} must be [T, G={G}, d={d}] with unit stride along d, got "
                             f"{tuple(x.shape)} strides {x.stride()}")
    T = k_TGd.shape[0]
    if v_TGd.shape[0] != T or slot_mapping_T.shape != (T,):
        raise ValueError(f"k, v and slot_mapping_T must agree on T={T}: v {tuple(v_TGd.shape)}, "
                         f"slots {tuple(slot_mapping_T.shape)}")
    if slot_mapping_T.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping_T must be int32 or int64, got {slot_mapping_T.dtype}")
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k_TGd, v_TGd, kv_cache_2NSGd, slot_mapping_T, k_TGd.stride(0), k_TGd.stride(1),
        v_TGd.stride(0), v_TGd.stride(1), N * S * G * d, G=G, HEAD_DIM=d,
        G_PAD=triton.next_power_of_2(G), D_PAD=triton.next_power_of_2(d), num_warps=4, **pdl_launch(k_TGd))
