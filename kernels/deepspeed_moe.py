"""backend="deepspeed": the CUTLASS MoE grouped GEMM of the `deepspeed-kernels` wheel, through ctypes.

The wheel (`pip install deepspeed-kernels`, or MOE_DEEPSPEED_FT_LIB=/path/to/libdeepspeedft.so) ships
FasterTransformer's `MoeGemmRunner<T, WeightVariant>` already compiled, with the CUDA runtime linked
in statically, so nothing is built here: the C++ member functions are called by their mangled names.
The kernels are Ampere-class CUTLASS 2.x grouped GEMMs (Sm80 MmaMultistage: cp.async + mma.sync, no
wgmma/TMA) from Oct 2023 (0.0.1.dev1698255861); on sm_90 the runner dispatches the same Sm80 kernels
(the fatbin holds SASS for sm_80/86/89/90 and PTX for compute_80..90).

Hopper (cc 9.x) is refused, measured on an H200 (torch 2.11+cu130, driver CUDA 13.0): the library's
host dispatch throws "[FT Error][MoE][GEMM Dispatch] Arch unsupported for MoE GEMM" for sm_90 (a
C++ exception: it aborts the process), and with the runner's recorded SM overwritten to 80 the
calls return without error but write nothing (outputs all zero, NaN from uninitialised rows).
So the backend runs on cc 8.x only, where its kernels were built to dispatch.

FT contract of `moe_gemm(this, A, B, weight_scales, C, ends, total_rows, n, k, num_experts, stream)`
(DeepSpeed-Kernels moe_gemm_kernels_template.h / moe_cutlass_kernel.h, DeepSpeed v2 moe_gemm.cu):
  A     [total_rows, k] row-major, the rows grouped by expert, expert 0 first;
  B     [E, k, n] row-major, one [k, n] matrix per expert (our weights transposed, contiguous);
  C     [total_rows, n]: only rows before ends[E-1] are written, the others keep what was there;
  ends  int64 [E] on the device, ends[e] = end row (exclusive) of expert e = inclusive cumsum of the
        counts. The kernel reads it on the device, so no host sync and a call is graph-capturable;
  weight_scales must be NULL for fp16/bf16 weights; total_rows only feeds the host tile heuristic;
  no workspace, no split-k; fp16 and bf16 only (no fp32 runner is instantiated); 128-bit accesses,
  so n and k must be multiples of 8 and the pointers 16-byte aligned (nothing checks it on the device).
A C++ exception thrown inside the library cannot cross ctypes (the process aborts), so every
requirement is checked here first and raised as a ValueError.

Memory: B must be [k, n] per expert, so the backend keeps a transposed copy of each expert weight it
is given (made once per weight tensor): twice the expert-weight memory. Fine for benchmarks and
tests; a serving path would transpose at load time instead.

Legend: T tokens, D hidden, E experts (local), F expert intermediate size, K top-k, R = T*K rows.
"""
from __future__ import annotations

import ctypes
import os
import struct
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

LIB_ENV = "MOE_DEEPSPEED_FT_LIB"
_HINT = (f"`pip install deepspeed-kernels` (extra moe-runtime[deepspeed]) or set "
         f"{LIB_ENV}=/path/to/libdeepspeedft.so")

# (constructor C1, moe_gemm) of fastertransformer::MoeGemmRunner<T, WeightVariant> (kFP16 = 0,
# kBF16 = 1); moe_gemm(const T*, const char*, const T*, T*, int64_t*, int64_t x3, int, cudaStream_t).
_CLASS = {torch.float16: "_ZN17fastertransformer13MoeGemmRunnerI6__halfL13WeightVariant0EE",
          torch.bfloat16: "_ZN17fastertransformer13MoeGemmRunnerI13__nv_bfloat16L13WeightVariant1EE"}
_SYMBOLS = {dtype: (cls + "C1Ev", cls + "8moe_gemmEPKS1_PKcS5_PS1_PlllliP11CUstream_st")
            for dtype, cls in _CLASS.items()}
# The object holds two ints (sm_, multi_processor_count_); the buffer is generous on purpose.
_OBJECT_BYTES = 256
_ALIGN_ELEMS, _ALIGN_BYTES = 8, 16

_libs: dict[str, ctypes.CDLL] = {}
_runners: dict[tuple[torch.dtype, int], "_MoeGemmRunner"] = {}
_transposed: WeakIdKeyDictionary = WeakIdKeyDictionary()


def wheel_library(file_name: str, env_var: str) -> str | None:
    """$env_var if set, else `file_name` in the installed `dskernels` package (the deepspeed-kernels
    wheel), else None."""
    env = os.environ.get(env_var)
    if env:
        return env
    try:
        import dskernels
    except ImportError:
        return None
    path = os.path.join(dskernels.library_path(), file_name)  # library_path() = package dir
    return path if os.path.isfile(path) else None


def library_path() -> str | None:
    """$MOE_DEEPSPEED_FT_LIB if set, else libdeepspeedft.so of the installed wheel, else None."""
    return wheel_library("libdeepspeedft.so", LIB_ENV)


def _library() -> ctypes.CDLL:
    path = library_path()
    if path is None:
        raise RuntimeError(f"backend 'deepspeed' needs libdeepspeedft.so, which was not found: {_HINT}")
    if path not in _libs:
        try:
            _libs[path] = ctypes.CDLL(path)
        except OSError as e:
            raise RuntimeError(f"backend 'deepspeed' cannot load {path}: {e}. {_HINT}") from e
    return _libs[path]


def _unsupported_arch(cc: tuple[int, int]) -> str | None:
    """Why the library cannot run on compute capability `cc`, or None if it can."""
    if cc < (8, 0):
        return (f"backend 'deepspeed' needs compute capability 8.x (its fatbin holds sm_80..sm_90 "
                f"code only), this GPU is {cc[0]}.{cc[1]}")
    if cc >= (9, 0):
        return (f"backend 'deepspeed' cannot run on compute capability {cc[0]}.{cc[1]}: the "
                "deepspeed-kernels MoE GEMM dispatch refuses sm_90 ('Arch unsupported for MoE "
                "GEMM'), and its Sm80 kernels forced onto an H200 write nothing; use 'triton'")
    return None


def available(device: torch.device | str) -> bool:
    """True when `device` is a CUDA device of compute capability 8.x and the library loads."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if _unsupported_arch(torch.cuda.get_device_capability(device)):
        return False
    try:
        _library()
    except RuntimeError:
        return False
    return True


class _MoeGemmRunner:
    """One C++ MoeGemmRunner per (dtype, device): its constructor reads the current device's SM
    version and SM count, which the tile heuristic and the persistent grid size use."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, device_index: int):
        ctor_name, gemm_name = _SYMBOLS[dtype]
        ctor = getattr(lib, ctor_name)
        ctor.restype, ctor.argtypes = None, [ctypes.c_void_p]
        self._gemm = getattr(lib, gemm_name)
        self._gemm.restype = None
        self._gemm.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_void_p]
        self._obj = ctypes.create_string_buffer(_OBJECT_BYTES)  # kept alive as long as the runner
        with torch.cuda.device(device_index):
            ctor(ctypes.addressof(self._obj))
        # The object is {int sm_; int multi_processor_count_;}: check that this is the library
        # this module was written against before any GEMM call (its errors abort the process).
        sm, sms = struct.unpack_from("ii", self._obj)
        props = torch.cuda.get_device_properties(device_index)
        if (sm, sms) != (props.major * 10 + props.minor, props.multi_processor_count):
            raise RuntimeError(f"backend 'deepspeed': unexpected MoeGemmRunner layout (read sm={sm}, "
                               f"SMs={sms}); refusing to call a library this module does not know")

    def __call__(self, a_RK, w_EKN, ends_E, out_RN, stream: int) -> None:
        R, K = a_RK.shape
        E, _, N = w_EKN.shape
        with torch.cuda.device(a_RK.device):  # the library's own runtime follows the current device
            self._gemm(ctypes.addressof(self._obj), a_RK.data_ptr(), w_EKN.data_ptr(), None, out_RN.data_ptr(),
                       ends_E.data_ptr(), R, N, K, E, stream)


def _runner(dtype: torch.dtype, device: torch.device) -> _MoeGemmRunner:
    if dtype not in _SYMBOLS:
        raise ValueError(f"backend 'deepspeed' runs fp16 and bf16 only, got {dtype}: deepspeed-kernels "
                         "instantiates no fp32 MoeGemmRunner")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (dtype, index) not in _runners:
        reason = _unsupported_arch(torch.cuda.get_device_capability(index))
        if reason:
            raise ValueError(f"{reason} (cuda:{index})")
        _runners[dtype, index] = _MoeGemmRunner(_library(), dtype, index)
    return _runners[dtype, index]


def _check_gemm(a_RK, w_EKN, ends_E, out_RN) -> None:
    tensors = {"a": a_RK, "w": w_EKN, "ends": ends_E, "out": out_RN}
    for name, t in tensors.items():
        if not t.is_cuda:
            raise ValueError(f"backend 'deepspeed' needs CUDA tensors, {name} is on {t.device}")
        if t.device != a_RK.device:
            raise ValueError(f"backend 'deepspeed': {name} is on {t.device}, a on {a_RK.device}")
        if not t.is_contiguous():
            raise ValueError(f"backend 'deepspeed': {name} must be contiguous")
    if a_RK.dtype not in _SYMBOLS:
        raise ValueError(f"backend 'deepspeed' runs fp16 and bf16 only, got {a_RK.dtype}: deepspeed-kernels "
                         "instantiates no fp32 MoeGemmRunner")
    if w_EKN.dtype != a_RK.dtype or out_RN.dtype != a_RK.dtype:
        raise ValueError(f"backend 'deepspeed': a, w, out must share one dtype, got {a_RK.dtype}, "
                         f"{w_EKN.dtype}, {out_RN.dtype}")
    if a_RK.dim() != 2 or w_EKN.dim() != 3 or w_EKN.shape[1] != a_RK.shape[1]:
        raise ValueError(f"backend 'deepspeed': a must be [R, K] and w [E, K, N], got {tuple(a_RK.shape)} "
                         f"and {tuple(w_EKN.shape)}")
    R, K = a_RK.shape
    E, _, N = w_EKN.shape
    if tuple(out_RN.shape) != (R, N):
        raise ValueError(f"backend 'deepspeed': out must be [{R}, {N}], got {tuple(out_RN.shape)}")
    if ends_E.dtype != torch.int64 or tuple(ends_E.shape) != (E,) or E < 1:
        raise ValueError(f"backend 'deepspeed': ends must be int64 [E] with E >= 1, got {ends_E.dtype} "
                         f"{tuple(ends_E.shape)} for E={E}")
    if K % _ALIGN_ELEMS or N % _ALIGN_ELEMS:
        raise ValueError(f"backend 'deepspeed': the CUTLASS kernels load 8 fp16/bf16 elements at a time, "
                         f"so K and N must be multiples of 8, got K={K}, N={N}")
    for name, t in tensors.items():
        if t.data_ptr() % _ALIGN_BYTES:
            raise ValueError(f"backend 'deepspeed': {name} must be 16-byte aligned")
    if max(R, N, K) >= 2 ** 31:
        raise ValueError("backend 'deepspeed': the kernels index problems with int32 (R, N, K < 2**31)")


def grouped_gemm_ft(a_RK: torch.Tensor, w_EKN: torch.Tensor, ends_E: torch.Tensor,
                    out_RN: torch.Tensor) -> torch.Tensor:
    """For each expert e: out[ends[e-1]:ends[e]] = a[ends[e-1]:ends[e]] @ w[e] (ends[-1] read as 0),
    on the current CUDA stream. Rows from ends[E-1] on are left untouched. Returns out_RN."""
    _check_gemm(a_RK, w_EKN, ends_E, out_RN)
    if a_RK.shape[0] == 0:
        return out_RN
    runner = _runner(a_RK.dtype, a_RK.device)
    runner(a_RK, w_EKN, ends_E, out_RN, torch.cuda.current_stream(a_RK.device).cuda_stream)
    return out_RN


def _transposed_EKN(w_ENK: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> contiguous [E, K, N], made once per weight tensor. clone() rather than
    contiguous(), so that the copy never references the key and the weak entry can die with it.
    (A weight changed in place afterwards would not be seen: weights are read-only here.)"""
    w_EKN = _transposed.get(w_ENK)
    if w_EKN is None:
        w_EKN = w_ENK.transpose(1, 2).clone(memory_format=torch.contiguous_format)
        _transposed[w_ENK] = w_EKN
    return w_EKN


Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def fused_experts_deepspeed(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    gemm: Gemm | None = None,
) -> torch.Tensor:
    """Same contract as kernels.reference.fused_experts_torch, the two GEMMs being FT grouped GEMMs.

    No host synchronisation (counts stay on the device), so a call can be captured in a CUDA graph.
    `gemm` (default: the library, grouped_gemm_ft) lets CPU tests inject a torch implementation of
    the same contract.
    """
    if gemm is None:
        gemm = grouped_gemm_ft
        if not hidden_states.is_cuda:
            raise ValueError(f"backend 'deepspeed' needs CUDA tensors, hidden_states is on "
                             f"{hidden_states.device}")
    T, D = hidden_states.shape
    E, F2, _ = w13.shape
    K = topk_ids.shape[1]
    dev = hidden_states.device

    ids_R = topk_ids.long().reshape(-1)
    if expert_map is not None:
        ids_R = expert_map.long()[ids_R]  # global -> local; -1 = not on this rank
    # Rows of experts held elsewhere get key E: they sort after every local expert, past ends[E-1],
    # where the kernel neither reads nor writes.
    keys_R = torch.where(ids_R < 0, E, ids_R)
    order_R = torch.argsort(keys_R, stable=True)
    sorted_keys_R = keys_R[order_R]
    # ends[e] = #rows with key <= e, the inclusive cumsum of the counts. searchsorted rather than
    # bincount: CUDA bincount copies the input's min/max to the host (a sync; no graph capture).
    ends_E = torch.searchsorted(sorted_keys_R, torch.arange(E, device=dev), right=True)
    token_of_row = order_R // K

    x_RD = hidden_states[token_of_row]
    empty = lambda n: torch.empty(T * K, n, dtype=hidden_states.dtype, device=dev)  # noqa: E731
    gate_up_RF2 = gemm(x_RD, _transposed_EKN(w13), ends_E, empty(F2))
    f = F2 // 2
    h_RF = F.silu(gate_up_RF2[:, :f]) * gate_up_RF2[:, f:]
    y_RD = gemm(h_RF, _transposed_EKN(w2), ends_E, empty(D))

    # Rows past ends[E-1] hold uninitialised memory: select, never multiply by 0 (NaN * 0 = NaN).
    weights_R = topk_weights.reshape(-1)[order_R].float()
    valid_R = sorted_keys_R < E
    contrib_RD = torch.where(valid_R[:, None], y_RD.float() * weights_R[:, None], 0.0)
    out_TD = torch.zeros(T, D, dtype=torch.float32, device=dev)
    out_TD.index_add_(0, token_of_row, contrib_RD)
    return out_TD.to(hidden_states.dtype)
