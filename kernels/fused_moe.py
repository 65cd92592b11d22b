"""The expert-layer seam: one call that every MoE block goes through, whatever the backend.

Weights come unquantised (the activation dtype), as FP8 e4m3 with block scales (DeepSeek-V3
`weight_scale_inv`: dequantised weight = fp8 * scale, one scale per bn x bk block), or as MXFP4
(gpt-oss: uint8 packed FP4 E2M1 codes with uint8 E8M0 scales, one per 32 input columns).

Legend: T tokens, D hidden, E experts held here, F expert intermediate size, K top-k;
block_shape = (bn, bk): bn rows (output dim) x bk columns (input dim) per scale.
"""
from __future__ import annotations

import math

import torch

from kernels import batch_invariant
from kernels.cpu_experts import fused_experts_cpu
from kernels.reference import check_activation, fused_experts_torch

FP8_DTYPE = torch.float8_e4m3fn
DEFAULT_BLOCK_SHAPE = (128, 128)
MXFP4_BLOCK = 32

_BACKENDS = ("torch", "reference", "triton", "deepspeed")


def _triton_usable(x: torch.Tensor) -> bool:
    if not x.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on `device`, best first."""
    probe = torch.empty(0, device=device)
    return (["triton"] if _triton_usable(probe) else []) + ["torch"]


def _check_shapes(x_TD, w13_EFD, w2_EDF, topk_weights_TK, topk_ids_TK, expert_map_E, mxfp4=False):
    """mxfp4: the weights' last dimension holds two codes a byte (w13 [E, 2F, D/2], w2 [E, D, F/2])."""
    if x_TD.dim() != 2:
        raise ValueError(f"hidden_states must be [T, D], got shape {tuple(x_TD.shape)}")
    T, D = x_TD.shape
    pack, what = (2, " (MXFP4: two E2M1 codes a byte, a checkpoint's [.., K/32, 16] blocks flattened)") \
        if mxfp4 else (1, "")
    if w13_EFD.dim() != 3 or w13_EFD.shape[2] * pack != D or w13_EFD.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2F, {D // pack}]{what}, got shape {tuple(w13_EFD.shape)}")
    E, F2, _ = w13_EFD.shape
    if tuple(w2_EDF.shape) != (E, D, F2 // 2 // pack):
        raise ValueError(f"w2 must be [{E}, {D}, {F2 // 2 // pack}]{what}, got shape {tuple(w2_EDF.shape)}")
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != T:
        raise ValueError(f"topk_ids must be [{T}, K], got shape {tuple(topk_ids_TK.shape)}")
    if topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(
            f"topk_weights {tuple(topk_weights_TK.shape)} and topk_ids "
            f"{tuple(topk_ids_TK.shape)} must have the same shape")
    if expert_map_E is not None and expert_map_E.dim() != 1:
        raise ValueError(f"expert_map must be 1-D [num_global_experts], got {tuple(expert_map_E.shape)}")


def _check_biases(x_TD, w13_EFD, w13_bias, w2_bias) -> None:
    """Expert biases: w13_bias [E, 2F], w2_bias [E, D], on the activations' device, fp32 or the
    activation dtype."""
    (E, F2), D = w13_EFD.shape[:2], x_TD.shape[1]
    for name, b, want in (("w13_bias", w13_bias, (E, F2)), ("w2_bias", w2_bias, (E, D))):
        if b is None:
            continue
        if not isinstance(b, torch.Tensor):
            raise ValueError(f"{name} must be a tensor or None, got {type(b).__name__}")
        if tuple(b.shape) != want:
            raise ValueError(f"{name} must be {list(want)}, got shape {tuple(b.shape)}")
        if b.device != x_TD.device:
            raise ValueError(f"{name} is on {b.device}, the hidden states on {x_TD.device}")
        if b.dtype not in (torch.float32, x_TD.dtype):
            raise ValueError(f"{name} must be float32 or the activation dtype {x_TD.dtype}, got {b.dtype}")


def _check_fp8(w13_EFD, w2_EDF, w13_scale, w2_scale, block_shape) -> tuple[int, int] | None:
    """FP8 weights need both scale grids, in fp32, of exactly the block grid's shape.
    Returns the block shape as a tuple, or None when the weights are not FP8."""
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("FP8 experts need both w13_scale and w2_scale (got only one)")
    if w13_scale is None:
        if w13_EFD.dtype == FP8_DTYPE or w2_EDF.dtype == FP8_DTYPE:
            raise ValueError("w13/w2 are float8_e4m3fn but no w13_scale/w2_scale were given")
        if block_shape is not None:
            raise ValueError("block_shape is only meaningful with FP8 weights and their scales")
        return None
    block = tuple(DEFAULT_BLOCK_SHAPE if block_shape is None else block_shape)
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block_shape must be (bn, bk) of positive ints, got {block_shape}")
    bn, bk = block
    for name, w in (("w13", w13_EFD), ("w2", w2_EDF)):
        if w.dtype != FP8_DTYPE:
            raise ValueError(f"with scales, {name} must be float8_e4m3fn, got {w.dtype}")
    E, F2, D = w13_EFD.shape
    F = F2 // 2
    want13 = (E, math.ceil(F2 / bn), math.ceil(D / bk))
    want2 = (E, math.ceil(D / bn), math.ceil(F / bk))
    for name, s, want in (("w13_scale", w13_scale, want13), ("w2_scale", w2_scale, want2)):
        if s.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {s.dtype}")
        if tuple(s.shape) != want:
            raise ValueError(f"{name} must be {list(want)} for block_shape {block}, got shape "
                             f"{tuple(s.shape)}")
    return block


def _is_mxfp4(w13_EFD, w2_EDF) -> bool:
    """uint8 weights are MXFP4 (both or neither)."""
    m13, m2 = w13_EFD.dtype == torch.uint8, w2_EDF.dtype == torch.uint8
    if m13 != m2:
        raise ValueError(f"MXFP4 experts need both w13 and w2 as uint8 (packed E2M1 codes), got w13 "
                         f"{w13_EFD.dtype} and w2 {w2_EDF.dtype}")
    return m13


def _check_mxfp4(x_TD, w13_EFD, w2_EDF, w13_scale, w2_scale, block_shape) -> None:
    """MXFP4 weights (w13/w2 uint8, shapes checked by _check_shapes) need both E8M0 scale tensors,
    uint8, one per 32 input columns: w13_scale [E, 2F, D/32], w2_scale [E, D, F/32]."""
    if x_TD.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"hidden_states must be bf16, fp16 or fp32 with MXFP4 experts, got {x_TD.dtype}")
    if block_shape is not None:
        raise ValueError("block_shape is for FP8 weights; MXFP4 blocks are fixed (32 input columns a "
                         "scale): pass block_shape=None")
    E, F2, _ = w13_EFD.shape
    D, F = x_TD.shape[1], F2 // 2
    if D % MXFP4_BLOCK or F % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 experts need D and F multiples of {MXFP4_BLOCK}, got D={D}, F={F}")
    if w13_scale is None or w2_scale is None:
        raise ValueError("MXFP4 experts (uint8 w13/w2) need both w13_scale and w2_scale (uint8 E8M0 "
                         f"scales [E, 2F, D/32] and [E, D, F/32]), got "
                         f"{'neither' if w13_scale is None and w2_scale is None else 'only one'}")
    want13, want2 = (E, F2, D // MXFP4_BLOCK), (E, D, F // MXFP4_BLOCK)
    for name, t, want in (("w13_scale", w13_scale, want13), ("w2_scale", w2_scale, want2)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a uint8 tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8 (E8M0 exponents) with MXFP4 weights, got {t.dtype}")
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must be {list(want)} (one scale per {MXFP4_BLOCK} input columns), "
                             f"got shape {tuple(t.shape)}")
    for name, t in (("w13", w13_EFD), ("w2", w2_EDF), ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if t.device != x_TD.device:
            raise ValueError(f"{name} is on {t.device}, the hidden states on {x_TD.device}")


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    backend: str | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] | None = None,
    defer_sum: bool = False,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """Run the routed experts of one MoE layer and sum their weighted outputs.

    Args:
        hidden_states: [T, D] activations (fp32, fp16 or bf16).
        w13: [E, 2F, D], per expert the gate rows then the up rows.
        w2: [E, D, F] down projection.
        topk_weights: [T, K] routed weights (applied in fp32 to each expert's output).
        topk_ids: [T, K] expert ids: global ids when `expert_map` is given, else local ids in [0, E).
        expert_map: optional [E_global] int tensor mapping global ids to local ids, -1 meaning the
            expert is not on this rank (that slot contributes zero).
        backend: "torch", "reference", "triton", "deepspeed", or None for the best one available on
            the tensors' device (triton, else torch). "torch" is the pure-torch path: on CPU fp32
            tensors the fast grouped form (kernels/cpu_experts.py), elsewhere the reference;
            "reference" always runs kernels.reference.fused_experts_torch, the oracle. "deepspeed"
            (the CUTLASS grouped GEMM of the optional deepspeed-kernels wheel, fp16/bf16 on CUDA,
            see kernels/deepspeed_moe.py) is only used when asked for by name, never chosen by None.
        w13_scale, w2_scale: FP8 mode (both or neither). w13/w2 are then float8_e4m3fn and the
            scales fp32 [E, ceil(2F/bn), ceil(D/bk)] and [E, ceil(D/bn), ceil(F/bk)] (the grids
            of the stacked [2F, D] and of [D, F]). "triton" runs the FP8 kernel (activations
            quantised per token and bk columns); "torch" dequantises every expert to the
            activation dtype on each call, then runs the reference (slow: tests, CPU); so does
            "reference".
        block_shape: (bn, bk) of the scales, default (128, 128); FP8 mode only.
        MXFP4 mode (gpt-oss's hub format): w13 uint8 [E, 2F, D/2] and w2 uint8 [E, D, F/2], two FP4
            E2M1 codes a byte (low nibble = even input column; the checkpoint's [.., K/32, 16]
            blocks flattened), with w13_scale uint8 [E, 2F, D/32] and w2_scale uint8 [E, D, F/32]
            (E8M0: weight = e2m1 * 2^(scale - 127)); D and F multiples of 32, block_shape None.
            "triton" dequantises the weight tiles in the GEMMs' K loops (4.25 bits read a weight,
            the MMA in the activation dtype); "torch" and "reference" dequantise every expert to
            the activation dtype on each call, then run the reference. Biases and both
            activations work as with unquantised weights; "deepspeed" has no MXFP4 path.
        defer_sum: the "triton" backend may return the unsummed top-k outputs as a
            kernels.triton_fused.moe_sum.TopKSum, which the caller's next RMSNorm sums
            (models/layers/norm.py); other backends ignore it.
        w13_bias: optional [E, 2F] bias of the gate_up projection (gate then up, as w13's rows),
            w2_bias: optional [E, D] bias of the down projection; fp32 or the activation dtype,
            added in fp32. b2 is added before the routed weight multiplies the expert's output
            (gpt-oss); rows of experts not on this rank (expert_map -1) get nothing, bias included.
        activation: "silu" (SiLU(gate) * up) or "swigluoai" (gpt-oss: gate = min(gate, limit),
            up = clamp(up, -limit, limit), gate * sigmoid(alpha * gate) * (up + 1)).
        swiglu_alpha, swiglu_limit: alpha and limit of "swigluoai" (gpt-oss config swiglu_alpha,
            swiglu_limit); unused by "silu".
        Biases and "swigluoai" run on "torch", "reference" and "triton" with unquantised or MXFP4
        weights; with FP8 weights or backend "deepspeed" they raise ValueError.
    Returns:
        [T, D] in the dtype of `hidden_states` (or a TopKSum, see defer_sum).
    """
    mxfp4 = _is_mxfp4(w13, w2)
    _check_shapes(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, mxfp4)
    if mxfp4:
        _check_mxfp4(hidden_states, w13, w2, w13_scale, w2_scale, block_shape)
        block = None
    else:
        block = _check_fp8(w13, w2, w13_scale, w2_scale, block_shape)
    check_activation(activation)
    _check_biases(hidden_states, w13, w13_bias, w2_bias)
    new_args = w13_bias is not None or w2_bias is not None or activation != "silu"
    if new_args and block is not None:
        raise ValueError("expert biases and the 'swigluoai' activation are not supported with FP8 "
                         "weights (w13_scale/w2_scale); use unquantised weights")
    extra = dict(w13_bias=w13_bias, w2_bias=w2_bias, activation=activation, swiglu_alpha=swiglu_alpha,
                 swiglu_limit=swiglu_limit)
    if backend is None:
        backend = "triton" if _triton_usable(hidden_states) else "torch"
    if backend in ("torch", "reference"):
        if mxfp4:
            from kernels.reference_mxfp4 import fused_experts_mxfp4_torch
            return fused_experts_mxfp4_torch(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights,
                                             topk_ids, expert_map, **extra)
        if block is not None:
            from kernels.reference_fp8 import fused_experts_fp8_torch
            return fused_experts_fp8_torch(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights,
                                           topk_ids, expert_map, block)
        if backend == "torch" and not hidden_states.is_cuda and not batch_invariant.enabled():
            return fused_experts_cpu(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, **extra)
        return fused_experts_torch(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, **extra)
    if backend == "triton":
        if mxfp4:
            from kernels.triton_moe import fused_experts_triton_mxfp4
            return fused_experts_triton_mxfp4(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights,
                                              topk_ids, expert_map, defer_sum=defer_sum, **extra)
        if block is not None:
            from kernels.triton_moe import fused_experts_triton_fp8
            return fused_experts_triton_fp8(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights,
                                            topk_ids, expert_map, block, defer_sum=defer_sum)
        from kernels.triton_moe import fused_experts_triton
        return fused_experts_triton(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, defer_sum=defer_sum,
                                    **extra)
    if backend == "deepspeed":
        if mxfp4:
            raise ValueError("backend 'deepspeed' has no MXFP4 path (deepspeed-kernels' MoE GEMM takes "
                             "fp16/bf16 weights); use backend 'triton' or 'torch' for MXFP4 experts")
        if block is not None:
            raise ValueError("backend 'deepspeed' has no FP8 path (deepspeed-kernels' MoE GEMM takes "
                             "fp16/bf16 weights); use backend 'triton' or 'torch' for FP8 experts")
        if new_args:
            raise ValueError("backend 'deepspeed' has no expert biases and only the 'silu' activation "
                             "(deepspeed-kernels' MoE GEMM); use backend 'triton' or 'torch' for "
                             "w13_bias/w2_bias/activation='swigluoai'")
        from kernels.deepspeed_moe import fused_experts_deepspeed
        return fused_experts_deepspeed(hidden_states, w13, w2, topk_weights, topk_ids, expert_map)
    raise ValueError(f"unknown fused_experts backend {backend!r}; choose one of {_BACKENDS} or None")
