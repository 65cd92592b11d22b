"""DeepSpeed-FastGen's blocked flash attention (libblockedflash.so of the `deepspeed-kernels` wheel),
called through ctypes: a contender measured beside the Triton paged-attention kernels
(benchmarks/deepspeed_flash_probe.py), not a serving path.

The library exports `run_mha_fwd(Flash_fwd_params&, cudaStream_t)`: a FlashAttention-2 forward over
a blocked KV cache, driven by "attention atoms" (DeepSpeed v2 ragged_ops, Oct 2023 build
0.0.1.dev1698255861). Its fatbin holds sm_80/86/89/90 SASS; the kernels are Ampere-class (mma.sync),
causal only, fp16/bf16, head sizes 32..256 in steps of 32.

What it expects, and how this module feeds it (the layout facts of DeepSpeed's flash.h and
attention_atom.h, restated here as ctypes structures):
  q, out   [T, H * d] rows of the ragged batch, heads contiguous;
  k, v     [num_blocks, block_size, G, d] each: our cache [2, N, S, G, d] split in two, as it is;
           block_size is a compile-time constant of the kernels, fixed by head size and GPU
           (`kv_block_size`: 64 for d = 128 on sm_90), so the cache must be built with it;
  atoms    int32 [A, 8], one per run of at most `q_block_size` queries of one sequence:
           (pointer to the sequence's int32 block ids, first query row, query count, KV blocks
           read, KV tokens seen by the last query, position of the first query, unused);
           built here from the block tables, query_start_loc and seq_lens (`build_atoms`).
Every requirement is checked before the call: a C++ exception inside the library cannot cross
ctypes and aborts the process.

Legend: T query tokens, B sequences, H query heads, G KV heads, d head dim, N blocks, S block size.
"""
from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from kernels.deepspeed_moe import wheel_library

LIB_ENV = "MOE_DEEPSPEED_FLASH_LIB"
_SYMBOL = "_Z11run_mha_fwdR16Flash_fwd_paramsP11CUstream_st"  # run_mha_fwd(Flash_fwd_params&, CUstream_st*)
HEAD_SIZES = (32, 64, 96, 128, 160, 192, 224, 256)  # the instantiated run_mha_fwd_<T, d>

_libs: dict[str, ctypes.CDLL] = {}


class QkvParams(ctypes.Structure):
    _fields_ = [("q_ptr", ctypes.c_void_p), ("k_ptr", ctypes.c_void_p), ("v_ptr", ctypes.c_void_p),
                ("q_row_stride", ctypes.c_uint32), ("k_row_stride", ctypes.c_uint32),
                ("v_row_stride", ctypes.c_uint32), ("q_head_stride", ctypes.c_uint32),
                ("k_head_stride", ctypes.c_uint32), ("v_head_stride", ctypes.c_uint32),
                ("h", ctypes.c_int), ("h_k", ctypes.c_int), ("h_h_k_ratio", ctypes.c_int)]


class FlashFwdParams(ctypes.Structure):
    """Flash_fwd_params, which derives from Qkv_params (a standard-layout base: its fields first)."""
    _fields_ = [("qkv", QkvParams), ("o_ptr", ctypes.c_void_p), ("atoms", ctypes.c_void_p),
                ("num_atoms", ctypes.c_int), ("o_row_stride", ctypes.c_uint32),
                ("o_head_stride", ctypes.c_uint32), ("d", ctypes.c_int), ("d_rounded", ctypes.c_int),
                ("scale_softmax", ctypes.c_float), ("scale_softmax_log2", ctypes.c_float),
                ("is_bf16", ctypes.c_bool), ("is_causal", ctypes.c_bool)]


ATOM_INT32S = 8  # int32* block_idx_list (two slots), q_start_idx, q_len, kv_blocks, total_extent, global_q_idx, unused


def q_block_size(head_dim: int, cc: tuple[int, int]) -> int:
    """Queries per atom the kernels are compiled for (DeepSpeed's get_q_block_size)."""
    major, minor = cc
    if head_dim <= 64 or head_dim == 192:
        return 128
    if head_dim <= 160 or head_dim == 224:
        return 128 if minor == 0 else 64
    return 128 if (major, minor) == (8, 0) else 64


def kv_block_size(head_dim: int, cc: tuple[int, int]) -> int:
    """KV-cache block size the kernels are compiled for (DeepSpeed's get_kv_block_size)."""
    if head_dim <= 64:
        return 128
    if head_dim != 160 or cc[1] != 0:
        return 64
    return 32


def library_path() -> str | None:
    """$MOE_DEEPSPEED_FLASH_LIB if set, else libblockedflash.so of the installed wheel, else None."""
    return wheel_library("libblockedflash.so", LIB_ENV)


def _run_mha_fwd():
    path = library_path()
    if path is None:
        raise RuntimeError(f"blocked flash attention needs libblockedflash.so: `pip install deepspeed-kernels` "
                           f"or set {LIB_ENV}")
    if path not in _libs:
        _libs[path] = ctypes.CDLL(path)
    fn = getattr(_libs[path], _SYMBOL)
    fn.restype, fn.argtypes = None, [ctypes.POINTER(FlashFwdParams), ctypes.c_void_p]
    return fn


def build_atoms(block_tables_BM: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                q_block: int, kv_block: int) -> torch.Tensor:
    """The atoms of a ragged batch: sequence b has queries at rows query_start_loc[b]..[b+1] and
    positions seq_lens[b] - n_b .. seq_lens[b] - 1. block_tables_BM must be a contiguous int32 tensor
    on the GPU that outlives the call (the atoms hold pointers to its rows). Returns int32 [A, 8]
    on block_tables_BM's device."""
    if block_tables_BM.dtype != torch.int32 or not block_tables_BM.is_contiguous():
        raise ValueError("block_tables_BM must be a contiguous int32 tensor (the atoms point into it)")
    B, M = block_tables_BM.shape
    if len(query_start_loc) != B + 1 or len(seq_lens) != B:
        raise ValueError(f"query_start_loc needs {B + 1} entries and seq_lens {B}, got "
                         f"{len(query_start_loc)} and {len(seq_lens)}")
    base, row_bytes = block_tables_BM.data_ptr(), M * 4
    rows = []
    for b in range(B):
        start, n = query_start_loc[b], query_start_loc[b + 1] - query_start_loc[b]
        first_pos = seq_lens[b] - n
        if n <= 0 or first_pos < 0 or math.ceil(seq_lens[b] / kv_block) > M:
            raise ValueError(f"sequence {b}: {n} queries, {seq_lens[b]} tokens, {M} blocks of {kv_block}")
        for j in range(0, n, q_block):
            q_len = min(q_block, n - j)
            end = first_pos + j + q_len  # KV tokens the atom's last query sees
            ptr = base + b * row_bytes
            rows.append([ptr & 0xFFFFFFFF, ptr >> 32, start + j, q_len, math.ceil(end / kv_block), end,
                         first_pos + j, 0])
    # Each field as its 32 bits (the pointer's high half may exceed int32's range as unsigned).
    atoms = np.asarray(rows, dtype=np.int64).astype(np.uint32).view(np.int32)
    return torch.from_numpy(atoms.copy()).to(block_tables_BM.device)


def _check(q_THd, kv_cache_2NSGd, out_THd) -> tuple[int, int, int, int]:
    if not q_THd.is_cuda:
        raise ValueError("blocked flash attention runs on CUDA tensors")
    cc = torch.cuda.get_device_capability(q_THd.device)
    if not ((8, 0) <= cc <= (9, 0)):
        raise ValueError(f"libblockedflash runs on compute capability 8.x and 9.0, not {cc[0]}.{cc[1]}")
    if q_THd.dtype not in (torch.float16, torch.bfloat16) or kv_cache_2NSGd.dtype != q_THd.dtype:
        raise ValueError(f"fp16/bf16 q and cache of one dtype, got {q_THd.dtype} and {kv_cache_2NSGd.dtype}")
    T, H, d = q_THd.shape
    _, N, S, G, d_kv = kv_cache_2NSGd.shape
    if d != d_kv or d not in HEAD_SIZES:
        raise ValueError(f"head size {d} (cache {d_kv}): the library has kernels for {HEAD_SIZES}")
    if H % G:
        raise ValueError(f"{H} query heads do not share {G} KV heads evenly")
    if S != kv_block_size(d, cc):
        raise ValueError(f"the kernels read blocks of {kv_block_size(d, cc)} tokens for head size {d} on this GPU; "
                         f"the cache has blocks of {S}")
    for name, t in (("q", q_THd), ("out", out_THd)):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError(f"{name} needs contiguous heads of contiguous elements")
    if kv_cache_2NSGd.stride(-1) != 1 or kv_cache_2NSGd.stride(-2) != d:
        raise ValueError("the cache needs contiguous heads of contiguous elements")
    return T, H, G, d


def blocked_flash_attention(q_THd: torch.Tensor, kv_cache_2NSGd: torch.Tensor, atoms: torch.Tensor,
                            scale: float, out_THd: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the ragged batch's queries over their blocked context (new K/V already in
    the cache), as described by `atoms` (`build_atoms`). Returns out [T, H, d]."""
    out = torch.empty_like(q_THd) if out_THd is None else out_THd
    T, H, G, d = _check(q_THd, kv_cache_2NSGd, out)
    if atoms.dtype != torch.int32 or atoms.dim() != 2 or atoms.shape[1] != ATOM_INT32S or not atoms.is_contiguous():
        raise ValueError(f"atoms must be a contiguous int32 [A, {ATOM_INT32S}] tensor")
    if atoms.device != q_THd.device:
        raise ValueError("atoms must be on the queries' device")
    k, v = kv_cache_2NSGd[0], kv_cache_2NSGd[1]
    p = FlashFwdParams()
    p.qkv = QkvParams(q_THd.data_ptr(), k.data_ptr(), v.data_ptr(), q_THd.stride(0), k.stride(1), v.stride(1),
                      d, d, d, H, G, H // G)
    p.o_ptr, p.atoms, p.num_atoms = out.data_ptr(), atoms.data_ptr(), atoms.shape[0]
    p.o_row_stride, p.o_head_stride = out.stride(0), d
    p.d, p.d_rounded = d, -(-d // 32) * 32
    p.scale_softmax, p.scale_softmax_log2 = scale, scale * math.log2(math.e)
    p.is_bf16, p.is_causal = q_THd.dtype == torch.bfloat16, True
    _run_mha_fwd()(ctypes.byref(p), torch.cuda.current_stream(q_THd.device).cuda_stream)
    return out
