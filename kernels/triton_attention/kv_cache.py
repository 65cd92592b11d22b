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
def store_token_heads(src_ptr, stride_g, dst_ptr, G, HEAD_DIM: tl.constexpr, G_PAD: tl.constexpr,
                      D_PAD: tl.constexpr):
    """One token's G heads of HEAD_DIM values (rows stride_g apart, unit stride along d) to dst_ptr
    (G * HEAD_DIM contiguous: a cache slot), cast to dst's dtype. Also used by the RoPE kernel
    (kernels/triton_fused/rope.py), which writes v to the cache in its own launch."""
    g = tl.arange(0, G_PAD)
    dd = tl.arange(0, D_PAD)
    mask = (g[:, None] < G) & (dd[None, :] < HEAD_DIM)
    x = tl.load(src_ptr + g[:, None] * stride_g + dd[None, :], mask=mask)
    tl.store(dst_ptr + g[:, None] * HEAD_DIM + dd[None, :], x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kv_ptr, slot_ptr, stride_kt, stride_kg, stride_vt, stride_vg,
                     v_offset, G: tl.constexpr, HEAD_DIM: tl.constexpr,
                     G_PAD: tl.constexpr, D_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    t64 = t.to(tl.int64)
    dst = kv_ptr + slot * (G * HEAD_DIM)
    store_token_heads(k_ptr + t64 * stride_kt, stride_kg, dst, G, HEAD_DIM, G_PAD, D_PAD)
    store_token_heads(v_ptr + t64 * stride_vt, stride_vg, dst + v_offset, G, HEAD_DIM, G_PAD, D_PAD)


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
                          slot_mapping_T: torch.Tensor) -> None:
    """Writes k_TGd[t] / v_TGd[t] to slot slot_mapping_T[t] of the K / V cache; -1 = skip.

    k_TGd, v_TGd: [T, G, d] with any strides along T and G but unit stride along d (views split
    from a fused qkv output are fine). Cast to the cache dtype. slot_mapping_T: [T] int32/int64.
    """
    check_kv_write(k_TGd, v_TGd, kv_cache_2NSGd, slot_mapping_T)
    _, N, S, G, d = kv_cache_2NSGd.shape
    T = k_TGd.shape[0]
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k_TGd, v_TGd, kv_cache_2NSGd, slot_mapping_T, k_TGd.stride(0), k_TGd.stride(1),
        v_TGd.stride(0), v_TGd.stride(1), N * S * G * d, G=G, HEAD_DIM=d,
        G_PAD=triton.next_power_of_2(G), D_PAD=triton.next_power_of_2(d), num_warps=4, **pdl_launch(k_TGd))
