"""Launchers of the Triton expert layer: align -> gate_up (SiLU*up fused) -> down (x weight) -> sum.

Optionally (fused_experts_triton's keywords) expert biases, added in the GEMMs' epilogues (b2
before the routed weight), and gpt-oss's clamped SwiGLU ("swigluoai") in place of SiLU*up; every
path (one_row_blocks, align_tokens, plain / split-K gate_up, plain / atomic / split-K down, moe_sum / TopKSum)
takes them.

MXFP4 weights (fused_experts_triton_mxfp4): the same flow, every path included, with the GEMMs'
W_MXFP4 form: packed E2M1 weights and E8M0 scales dequantised tile by tile in registers (see
gemm.py, mxfp4.py), activations and h in their own dtype; configs under the dtype key "mxfp4".

Legend: T tokens, D hidden, E local experts, F expert intermediate, K top-k, P padded rows.

No host synchronisation and no data-dependent allocation: every buffer is sized from shapes, the
number of used blocks stays on the device, so the whole call can be captured in a CUDA graph.
"""
from __future__ import annotations

import os

import torch
import triton

from kernels import batch_invariant
from kernels.pdl import pdl_launch
from kernels.reference import check_activation
from kernels.triton_fused.moe_sum import TopKSum, moe_sum
from kernels.triton_moe.align import align_tokens
from kernels.triton_moe.config import get_config, split_config
from kernels.triton_moe.gemm import down_kernel, gate_up_finish_kernel, gate_up_kernel
from kernels.triton_moe.quant import FP8_DTYPE, per_token_group_quant_fp8

# The columns of h a program of gate_up_finish_kernel (a split gate_up's bias and activation) writes.
FINISH_BLOCK_N = 128

# moe_sum up to this many tokens (measured up to here); MOE_SUM_KERNEL=0 keeps torch's sum (A/B runs).
MOE_SUM_MAX_TOKENS = 256 if os.environ.get("MOE_SUM_KERNEL", "1") != "0" else 0
# The top-k sum is left to the next RMSNorm (defer_sum) from this many tokens: in a decode graph on
# an H200 it saved 0.07 ms a step at 256 tokens and 0.01 at 32, but cost 0.02 at one token, where
# the norm's single program replaces moe_sum's eight (BENCHMARKS.md §1).
DEFER_SUM_MIN_TOKENS = 32
# Beyond MOE_SUM_MAX_TOKENS too (mixed and prefill steps, where the sum would be torch's reduction,
# 17 us a layer beside 255 decodes + a 512-token chunk on an H200); MOE_DEFER_SUM_LARGE=0: only up
# to it (A/B runs).
DEFER_SUM_LARGE = os.environ.get("MOE_DEFER_SUM_LARGE", "1") != "0"
# MXFP4 weights through tl.dot_scaled (the compiler's E2M1 upcast) instead of the kernels' own
# dequantisation (mxfp4.py), for 16-bit activations. "auto": for decode tiles (BLOCK_SIZE_M 16,
# BLOCK_SIZE_N and BLOCK_SIZE_K >= 64), 1.28-1.38x faster there on an H100 and an H200 (BENCHMARKS.md
# §1); the kernels' own elsewhere (0.93-0.97x at BLOCK_SIZE_M 64, a tie at 128), and for smaller tiles,
# whose E2M1 conversion Triton 3.6 fails to lower. MOE_MXFP4_DOT_SCALED=1 / 0: every tile / none (A/B runs).
# A config's SWAP_AB wins over both (the shipped and default decode tiles: faster than dot_scaled, gemm.py).
MXFP4_DOT_SCALED = os.environ.get("MOE_MXFP4_DOT_SCALED", "auto")


def mxfp4_dot_scaled(launch: dict, dtype: torch.dtype) -> str:
    """The GEMM's MXFP4_SCALED argument for this launch config: the activations' format ("bf16",
    "fp16") when its MXFP4 tiles go through tl.dot_scaled (MXFP4_DOT_SCALED), else ""."""
    if dtype not in (torch.bfloat16, torch.float16) or MXFP4_DOT_SCALED == "0":
        return ""
    decode_tile = launch["BLOCK_SIZE_M"] <= 16 and launch["BLOCK_SIZE_N"] >= 64 and launch["BLOCK_SIZE_K"] >= 64
    if MXFP4_DOT_SCALED != "1" and not decode_tile:
        return ""
    return "bf16" if dtype == torch.bfloat16 else "fp16"


# A step of one token skips the alignment launch (one_row_blocks); MOE_DIRECT_ALIGN=0 keeps it (A/B runs).
DIRECT_ALIGN = os.environ.get("MOE_DIRECT_ALIGN", "1") != "0"
_ONE_ROW_SORTED: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def one_row_blocks(topk_ids_TK: torch.Tensor, block_m: int):
    """align_tokens' result for rows that need no sorting: block r holds flat row r alone, its
    expert the row's id. For a single token (K distinct experts) this is exactly the aligned
    layout, computed without a launch: the ids are the block experts, and the sorted rows and
    their count are constants of (K, BM), kept per device (a captured graph keeps reading them).
    Needs local ids in [0, E) (no expert map)."""
    R, dev = topk_ids_TK.numel(), topk_ids_TK.device
    key = (R, block_m, dev)
    consts = _ONE_ROW_SORTED.get(key)
    if consts is None:
        sorted_ids = torch.full((R * block_m,), R, dtype=torch.int32, device=dev)
        sorted_ids[::block_m] = torch.arange(R, dtype=torch.int32, device=dev)
        consts = (sorted_ids, torch.full((1,), R * block_m, dtype=torch.int32, device=dev))
        # Filled while a graph is captured, they would hold their values only once it replays:
        # kept only when built eagerly (the graphs' warm-up forward builds them first).
        if not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _ONE_ROW_SORTED[key] = consts
    return consts[0], topk_ids_TK.reshape(-1), consts[1]


def tma_descriptors(h_PF: torch.Tensor, w2_EDF: torch.Tensor, block_m: int, block_n: int, block_k: int):
    """The down GEMM's TMA descriptors (config "TMA" under "down"): h [P, F] in [block_m, block_k]
    tiles and w2 [E, D, F] viewed as [E * D, F] in [block_n, block_k] tiles; None where TMA cannot read
    them (before Hopper, off the GPU without the interpreter, rows not stacked, or not 16-byte aligned),
    and the GEMM loads its tiles by pointer."""
    dev = h_PF.device
    if dev.type == "cuda":
        if torch.cuda.get_device_capability(dev)[0] < 9:
            return None
    elif os.environ.get("TRITON_INTERPRET") != "1":
        return None
    E, D, F = w2_EDF.shape
    size = h_PF.element_size()
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and (t.stride(-2) * size) % 16 == 0
                  for t in (h_PF, w2_EDF))
    if not aligned or w2_EDF.stride(0) != D * w2_EDF.stride(1) or block_k * size < 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor
    return (TensorDescriptor(h_PF, list(h_PF.shape), [h_PF.stride(0), 1], [block_m, block_k]),
            TensorDescriptor(w2_EDF, [E * D, F], [w2_EDF.stride(1), 1], [block_n, block_k]))


def _bias_args(bias: torch.Tensor | None) -> dict:
    """The kernels' bias keywords: pointer and strides, HAS_BIAS (nothing extra when None)."""
    if bias is None:
        return {}
    return {"b_ptr": bias, "stride_be": bias.stride(0), "stride_bn": bias.stride(1), "HAS_BIAS": True}


def _run(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, expert_map_E, cfg,
         fp8=None, block_shape=(128, 128), defer_sum=False, w13_bias=None, w2_bias=None,
         activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0, mxfp4=None):
    """mxfp4: (w13_scale, w2_scale) uint8 when w13/w2 are packed MXFP4 (uint8 [E, 2F, D/2], [E, D, F/2])."""
    T, D = x_TD.shape
    E, F2, _ = w13_EFD.shape
    F = F2 // 2
    K = topk_ids_TK.shape[1]
    out_dtype = x_TD.dtype
    if T == 0:
        return x_TD.new_zeros(0, D)
    up, down = split_config(cfg)
    BM = up["BLOCK_SIZE_M"]
    if mxfp4 is None and (up.get("SWAP_AB") or down.get("SWAP_AB")):
        raise ValueError(f"SWAP_AB is for MXFP4 weights, got {cfg}")
    if T == 1 and expert_map_E is None and DIRECT_ALIGN:
        sorted_ids, expert_ids, npp = one_row_blocks(topk_ids_TK, BM)
    else:
        sorted_ids, expert_ids, npp = align_tokens(topk_ids_TK, E, BM, expert_map_E)
    P, n_mb = sorted_ids.numel(), expert_ids.numel()
    dev = x_TD.device
    topk_w = topk_weights_TK.reshape(-1)
    if not topk_w.is_contiguous():
        topk_w = topk_w.contiguous()
    use_fp8 = fp8 is not None
    use_mxfp4 = mxfp4 is not None
    if use_fp8 and use_mxfp4:
        raise ValueError("weights are either FP8 or MXFP4, not both")
    if use_mxfp4 and (up["BLOCK_SIZE_K"] % 32 or down["BLOCK_SIZE_K"] % 32):
        raise ValueError(f"MXFP4 weights need BLOCK_SIZE_K a multiple of 32 (the scale block) in both "
                         f"GEMMs, got {cfg}")
    if use_fp8 and up.get("SPLIT_K", 1) > 1:
        raise ValueError(f"the FP8 gate_up GEMM quantises h in its epilogue and cannot split D (SPLIT_K), got {cfg}")
    if use_fp8 and (w13_bias is not None or w2_bias is not None or activation != "silu"):
        raise ValueError("the FP8 expert kernel has no biases and only the 'silu' activation")
    check_activation(activation)
    act = {} if activation == "silu" else {"ACTIVATION": activation, "swiglu_alpha": float(swiglu_alpha),
                                           "swiglu_limit": float(swiglu_limit)}
    GN, GK = block_shape if use_fp8 else (1, 1)
    if use_fp8:
        w13_scale, w2_scale = fp8
        if up["BLOCK_SIZE_K"] != GK or down["BLOCK_SIZE_K"] != GK or up["BLOCK_SIZE_N"] != GK:
            raise ValueError(f"FP8 block {block_shape} needs BLOCK_SIZE_K == {GK} and a gate_up "
                             f"BLOCK_SIZE_N == {GK}, got {cfg}")
        a_TD, a_scale = per_token_group_quant_fp8(x_TD, GK)
        h = torch.empty(P, F, dtype=FP8_DTYPE, device=dev)
        h_scale = torch.empty(P, triton.cdiv(F, GK), dtype=torch.float32, device=dev)
        xs_strides = a_scale.stride()
        ws13_strides, ws2_strides = w13_scale.stride(), w2_scale.stride()
        hs_strides = h_scale.stride()
    else:
        a_TD = x_TD
        h = torch.empty(P, F, dtype=x_TD.dtype, device=dev)
        a_scale = w13_scale = w2_scale = h_scale = h  # unused placeholders
        xs_strides = ws13_strides = ws2_strides = hs_strides = (0, 0, 0)
        if use_mxfp4:  # the E8M0 scales go where FP8's weight scales would
            w13_scale, w2_scale = mxfp4
            ws13_strides, ws2_strides = w13_scale.stride(), w2_scale.stride()
    # SWAP_AB: the tiles dequantised here, as the MMA's A operand (never tl.dot_scaled)
    mx_up, mx_down = ({"W_MXFP4": True, "SWAP_AB": True, "MXFP4_SCALED": ""} if c.get("SWAP_AB") else
                      {"W_MXFP4": True, "MXFP4_SCALED": mxfp4_dot_scaled(c, x_TD.dtype)} for c in (up, down)) \
        if use_mxfp4 else ({}, {})  # nothing extra otherwise: the same compiled kernels
    if down.get("TMA") and (use_fp8 or use_mxfp4 or down.get("HALF_TILES")):
        raise ValueError(f"the down GEMM's TMA tiles are for 16/32-bit weights, without HALF_TILES, got {cfg}")
    for c in (up, down):
        if c.get("HALF_TILES") and BM < 32:
            raise ValueError(f"HALF_TILES needs BLOCK_SIZE_M >= 32 (tiles of BLOCK_SIZE_M / 2 >= 16 rows), got {cfg}")
    half_up = {"HALF_TILES": True} if up.get("HALF_TILES") else {}
    half_down = {"HALF_TILES": True} if down.get("HALF_TILES") else {}
    precision = "ieee" if x_TD.dtype == torch.float32 else "tf32"
    upcast = x_TD.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    pdl = pdl_launch(x_TD)

    # Split (config "SPLIT_K" > 1, not FP8): the D range over programs adding into a zeroed fp32
    # [P, 2F], then one launch for the bias and the activation.
    split_up = max(1, min(int(up.get("SPLIT_K", 1)), triton.cdiv(D, up["BLOCK_SIZE_K"])))
    gu = torch.zeros(P, 2 * F, dtype=torch.float32, device=dev) if split_up > 1 else None
    split_args = {"SPLIT_K": split_up, "gu_ptr": gu, "stride_gum": gu.stride(0)} if gu is not None else {}
    grid = (n_mb * triton.cdiv(F, up["BLOCK_SIZE_N"]), split_up)
    gate_up_kernel[grid](
        a_TD, w13_EFD, h, sorted_ids, expert_ids, npp, a_scale, w13_scale, h_scale,
        F, D, T * K, K, n_mb,
        a_TD.stride(0), a_TD.stride(1), *w13_EFD.stride(), h.stride(0), h.stride(1),
        xs_strides[0], xs_strides[1], *ws13_strides[:3], hs_strides[0], hs_strides[1],
        BLOCK_M=BM, BLOCK_N=up["BLOCK_SIZE_N"], BLOCK_K=up["BLOCK_SIZE_K"],
        GROUP_M=up["GROUP_SIZE_M"], GN=GN, GK=GK, USE_FP8=use_fp8,
        EVEN_K=D % up["BLOCK_SIZE_K"] == 0, PRECISION=precision, UPCAST=upcast,
        num_warps=up["num_warps"], num_stages=up["num_stages"], **pdl, **_bias_args(w13_bias), **act, **mx_up,
        **half_up, **split_args)
    if gu is not None:
        gate_up_finish_kernel[(n_mb, triton.cdiv(F, FINISH_BLOCK_N))](
            gu, h, expert_ids, npp, F, gu.stride(0), h.stride(0), h.stride(1), BLOCK_M=BM, BLOCK_N=FINISH_BLOCK_N,
            **pdl, **_bias_args(w13_bias), **act)

    # Plain: top-1 writes the output directly, top-k > 1 writes [T*K, D], then a sum over K.
    # Atomic (config "ATOMIC_SUM", or "SPLIT_K" > 1): fp32 atomics into a zeroed [T, D], then
    # one cast; no [T*K, D] round trip, and the F range can be split when there are few tiles.
    split = max(1, min(int(down.get("SPLIT_K", 1)), triton.cdiv(F, down["BLOCK_SIZE_K"])))
    atomic = split > 1 or bool(down.get("ATOMIC_SUM", False))
    if atomic:
        out = torch.zeros(T, D, dtype=torch.float32, device=dev)
    else:
        out = torch.empty(T * K, D, dtype=out_dtype, device=dev)
    grid = (n_mb * triton.cdiv(D, down["BLOCK_SIZE_N"]), split)
    tma = tma_descriptors(h, w2_EDF, BM, down["BLOCK_SIZE_N"], down["BLOCK_SIZE_K"]) if down.get("TMA") else None
    down_kernel[grid](
        *((h, w2_EDF) if tma is None else tma), out, sorted_ids, expert_ids, npp, topk_w, h_scale, w2_scale,
        D, F, T * K, K, n_mb,
        h.stride(0), h.stride(1), *w2_EDF.stride(), out.stride(0), out.stride(1),
        hs_strides[0], hs_strides[1], *ws2_strides[:3],
        BLOCK_M=BM, BLOCK_N=down["BLOCK_SIZE_N"], BLOCK_K=down["BLOCK_SIZE_K"],
        GROUP_M=down["GROUP_SIZE_M"], GN=GN, GK=GK, USE_FP8=use_fp8,
        EVEN_K=F % down["BLOCK_SIZE_K"] == 0, SPLIT_K=split, ATOMIC=atomic,
        PRECISION=precision, UPCAST=upcast,
        num_warps=down["num_warps"], num_stages=down["num_stages"], **pdl, **_bias_args(w2_bias), **mx_down,
        **half_down, **({} if tma is None else {"TMA": True}))
    if atomic:
        return out.to(out_dtype)  # no copy for fp32
    if K == 1:
        return out
    invariant = batch_invariant.enabled()  # one sum whatever T: moe_sum (slot order, per token)
    if defer_sum and not invariant and T >= DEFER_SUM_MIN_TOKENS and (DEFER_SUM_LARGE or T <= MOE_SUM_MAX_TOKENS):
        return TopKSum(out.view(T, K, D))
    if T <= MOE_SUM_MAX_TOKENS or invariant:  # one Triton launch, faster than torch's there (BENCHMARKS.md §1)
        return moe_sum(out.view(T, K, D))
    return out.view(T, K, D).sum(dim=1)  # accumulates in fp32 for half types


def fused_experts_triton(hidden_states, w13, w2, topk_weights, topk_ids, expert_map=None,
                         config: dict | None = None, defer_sum: bool = False, *,
                         w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                         activation: str = "silu", swiglu_alpha: float = 1.702,
                         swiglu_limit: float = 7.0):
    """Triton expert layer; same contract as ``kernels.fused_experts``.

    Args:
        hidden_states: [T, D] fp32, fp16 or bf16.
        w13: [E, 2F, D] gate rows then up rows, same dtype. w2: [E, D, F].
        topk_weights: [T, K] float routed weights (applied in fp32).
        topk_ids: [T, K] int expert ids (global if `expert_map` is given, else local in [0, E)).
        expert_map: optional [E_global] int, global -> local id, -1 = not on this rank (zero).
        config: optional launch config (see config.py); default: tuned file or default.
        defer_sum: where the top-k sum would be a moe_sum launch of at least DEFER_SUM_MIN_TOKENS
            tokens, return the unsummed outputs as a TopKSum instead (for the next RMSNorm to sum).
        w13_bias: optional [E, 2F] (gate then up), w2_bias: optional [E, D], fp32 or the
            activation dtype, added in fp32 (b2 before the routed weight).
        activation: "silu" or "swigluoai" (gpt-oss, with swiglu_alpha and swiglu_limit).
    Returns:
        [T, D] in the dtype of `hidden_states` (or a TopKSum, see defer_sum).
    """
    if config is None:
        E, F2, _ = w13.shape
        config = get_config(hidden_states.shape[0], E, F2 // 2, topk_ids.shape[1],
                            hidden_states.dtype)
    return _run(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, config, defer_sum=defer_sum,
                w13_bias=w13_bias, w2_bias=w2_bias, activation=activation, swiglu_alpha=swiglu_alpha,
                swiglu_limit=swiglu_limit)


def fused_experts_triton_fp8(hidden_states, w13_fp8, w2_fp8, w13_scale, w2_scale, topk_weights,
                             topk_ids, expert_map=None, block_shape=(128, 128),
                             config: dict | None = None, defer_sum: bool = False):
    """Expert layer with FP8 e4m3 block-quantised weights and dynamic per-token-group FP8 inputs.

    Args:
        hidden_states: [T, D] bf16/fp16/fp32; quantised per (token, block_shape[1] columns).
        w13_fp8: [E, 2F, D] float8_e4m3fn. w2_fp8: [E, D, F] float8_e4m3fn.
        w13_scale: [E, ceil(2F/bn), ceil(D/bk)] fp32 (DeepSeek-V3 `weight_scale_inv`:
            dequant = fp8 * scale). w2_scale: [E, ceil(D/bn), ceil(F/bk)] fp32.
        topk_weights, topk_ids, expert_map: as in :func:`fused_experts_triton`.
        block_shape: (bn, bk) of the weight scales; bk is also the activation group size.
        defer_sum: as in :func:`fused_experts_triton`.
    Returns:
        [T, D] in the dtype of `hidden_states` (or a TopKSum, see defer_sum).
    """
    block_shape = tuple(block_shape)
    if config is None:
        E, F2, _ = w13_fp8.shape
        config = get_config(hidden_states.shape[0], E, F2 // 2, topk_ids.shape[1], "fp8_w8a8",
                            block_shape)
    return _run(hidden_states, w13_fp8, w2_fp8, topk_weights, topk_ids, expert_map, config,
                fp8=(w13_scale.float(), w2_scale.float()), block_shape=block_shape, defer_sum=defer_sum)


def fused_experts_triton_mxfp4(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids,
                               expert_map=None, config: dict | None = None, defer_sum: bool = False, *,
                               w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                               activation: str = "silu", swiglu_alpha: float = 1.702,
                               swiglu_limit: float = 7.0):
    """Expert layer with MXFP4 weights (gpt-oss's hub format), dequantised in the GEMMs' K loops.

    Args:
        hidden_states: [T, D] bf16/fp16 (fp32 works too: weights dequantised to fp32), D % 32 == 0.
        w13: uint8 [E, 2F, D/2], the packed E2M1 codes of the gate rows then the up rows (two a
            byte, low nibble = even column). w2: uint8 [E, D, F/2], F % 32 == 0.
        w13_scale: uint8 [E, 2F, D/32], w2_scale: uint8 [E, D, F/32]: E8M0 scales, one per 32
            columns (weight = e2m1 * 2^(scale - 127)).
        topk_weights, topk_ids, expert_map, defer_sum, w13_bias, w2_bias, activation,
        swiglu_alpha, swiglu_limit: as in :func:`fused_experts_triton`.
        config: optional launch config (BLOCK_SIZE_K a multiple of 32); default: the tuned file
            of dtype "mxfp4", else config.default_config.
    Returns:
        [T, D] in the dtype of `hidden_states` (or a TopKSum, see defer_sum).
    """
    if config is None:
        E, F2, _ = w13.shape
        config = get_config(hidden_states.shape[0], E, F2 // 2, topk_ids.shape[1], "mxfp4")
    return _run(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, config, defer_sum=defer_sum,
                w13_bias=w13_bias, w2_bias=w2_bias, activation=activation, swiglu_alpha=swiglu_alpha,
                swiglu_limit=swiglu_limit, mxfp4=(w13_scale, w2_scale))
