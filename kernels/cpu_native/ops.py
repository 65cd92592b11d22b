"""Python faces of the native CPU kernels (paged_decode.c, norm_rope.c, experts.c): each returns
None (or False) where it does not serve (no library, not fp32, a layout it does not take), and the
caller runs its torch twin.

Legend: T tokens, D hidden, H heads, d head dim, R rotary dims (in rope) or T * K routed rows,
E local experts, F expert intermediate, K top-k.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import cpu_native

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


def _serves(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    if any(t.is_cuda or t.dtype != torch.float32 or t.stride(-1) != 1 for t in tensors):
        return None
    return cpu_native.library()


def _p(t: torch.Tensor | None) -> ctypes.c_void_p:
    return _ptr(t.data_ptr() if t is not None else None)


def paged_decode(out_THd: torch.Tensor, q_THd: torch.Tensor, kv_cache_2NSGd: torch.Tensor, scale: float,
                 tables_BW: torch.Tensor, lens_B: torch.Tensor, firsts_B: torch.Tensor, rows_B: torch.Tensor) -> bool:
    """kernels/cpu_attention.py's decode rows in one call: out_THd[rows_B[b]] = attention of query row
    rows_B[b] over positions firsts_B[b] .. lens_B[b] - 1 of its paged context (contiguous int32
    tables_BW / lens_B / firsts_B, int64 rows_B; fp32 q, out and a contiguous [2, N, S, G, d] cache).
    False where the kernel does not serve."""
    lib = _serves(q_THd, out_THd, kv_cache_2NSGd)
    if lib is None or not kv_cache_2NSGd.is_contiguous():
        return False
    _, N, S, G, d = kv_cache_2NSGd.shape
    lib.moe_paged_decode_f32(
        _p(q_THd), _i64(q_THd.stride(0)), _i64(q_THd.stride(1)), _p(kv_cache_2NSGd), _i64(N), _i64(S), _i64(G),
        _i64(d), _p(tables_BW), _i64(tables_BW.stride(0)), _p(lens_B), _p(firsts_B), _p(rows_B),
        _i64(rows_B.shape[0]), _i64(q_THd.shape[1]), ctypes.c_float(scale), _p(out_THd), _i64(out_THd.stride(0)),
        _i64(out_THd.stride(1)))
    return True


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float, residual_TD: torch.Tensor | None = None):
    """models/layers/norm.py's RMSNorm.forward for 2-D fp32 x: norm(x), or with a residual
    (norm(x + residual), x + residual) as new tensors. None where the kernel does not serve."""
    T, D = x_TD.shape if x_TD.dim() == 2 else (0, -1)
    if x_TD.dim() != 2 or weight_D.shape != (D,) or (residual_TD is not None and residual_TD.shape != x_TD.shape):
        return None
    weight = weight_D.contiguous()
    lib = _serves(x_TD, weight, *(() if residual_TD is None else (residual_TD,)))
    if lib is None:
        return None
    out = torch.empty(T, D, dtype=torch.float32)
    total = torch.empty(T, D, dtype=torch.float32) if residual_TD is not None else None
    lib.moe_rms_norm_f32(_p(x_TD), _i64(x_TD.stride(0)), _p(residual_TD),
                         _i64(residual_TD.stride(0) if residual_TD is not None else 0), _p(total), _i64(D),
                         _p(weight), _p(out), _i64(D), _i64(T), _i64(D), ctypes.c_float(eps))
    return out if residual_TD is None else (out, total)


def rope(positions_T: torch.Tensor, q_THd: torch.Tensor, k_TGd: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor, rotary_dim: int, neox: bool, q_weight: torch.Tensor | None = None,
         k_weight: torch.Tensor | None = None, eps: float = 0.0):
    """models/layers/rotary.py's RotaryEmbedding on fp32 q [T, H, d] and k [T, G, d] (any token and
    head strides): the rotated (q, k) as new contiguous tensors; with q_weight / k_weight, each
    head RMSNormed first (Qwen3's q/k norm). cos/sin: fp32 [max_position, R / 2]. None where the
    kernel does not serve."""
    if q_THd.dim() != 3 or k_TGd.dim() != 3 or q_THd.shape[2] != k_TGd.shape[2] or rotary_dim % 2:
        return None
    d = q_THd.shape[2]
    norms = [w.contiguous() for w in (q_weight, k_weight) if w is not None]
    if len(norms) == 1 or any(w.shape != (d,) for w in norms):
        return None
    lib = _serves(q_THd, k_TGd, cos, sin, *norms)
    if lib is None or not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    T, H, G = q_THd.shape[0], q_THd.shape[1], k_TGd.shape[1]
    pos = positions_T.to(torch.int64).contiguous()
    q_w, k_w = (norms[0], norms[1]) if norms else (None, None)
    q_out, k_out = torch.empty(T, H, d, dtype=torch.float32), torch.empty(T, G, d, dtype=torch.float32)
    lib.moe_rope_f32(_p(q_THd), _i64(q_THd.stride(0)), _i64(q_THd.stride(1)), _p(k_TGd), _i64(k_TGd.stride(0)),
                     _i64(k_TGd.stride(1)), _i64(T), _i64(H), _i64(G), _i64(d), _i64(rotary_dim), _p(pos),
                     _p(cos), _p(sin), ctypes.c_int(int(neox)), _p(q_w), _p(k_w), ctypes.c_float(eps),
                     _p(q_out), _p(k_out))
    return q_out, k_out


def experts(x_TD: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, weights_R: torch.Tensor,
            ids_R: torch.Tensor, K: int) -> torch.Tensor | None:
    """kernels/cpu_experts.py's expert layer on fp32 tensors: [T, D], the routed rows' weighted
    outputs summed per token. ids_R: [T * K] local expert of each routed row, -1 = not on this rank;
    weights_R: [T * K]. None where the kernel does not serve."""
    if not (w13_EFD.is_contiguous() and w2_EDF.is_contiguous()):
        return None
    lib = _serves(x_TD, w13_EFD, w2_EDF, weights_R)
    if lib is None:
        return None
    T, D = x_TD.shape
    E, F2, _ = w13_EFD.shape
    ids = ids_R.to(torch.int32).contiguous()
    weights = weights_R.contiguous()
    out = torch.empty(T, D, dtype=torch.float32)
    status = lib.moe_experts_f32(_p(x_TD), _i64(x_TD.stride(0)), _p(w13_EFD), _p(w2_EDF), _p(ids), _p(weights),
                                 _i64(T), _i64(K), _i64(E), _i64(D), _i64(F2 // 2), _p(out))
    return out if status == 0 else None  # -1 (ctypes reads an int return by default): buffers not allocated
