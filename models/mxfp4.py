"""MXFP4 weights (OCP Microscaling FP4, as gpt-oss's hub checkpoints store their experts).

A tensor [..., N] is stored as `blocks` uint8 [..., N / 32, 16] (32 FP4 E2M1 values per block, two
per byte: the low nibble is the even element, the high nibble the odd one) and `scales` uint8
[..., N / 32] (one E8M0 power of two per block: value = fp4 * 2^(scale - 127)).
"""
from __future__ import annotations

import logging

import torch

import kernels

logger = logging.getLogger("moe.mxfp4")

# The 16 E2M1 codes: sign bit, 2 exponent bits, 1 mantissa bit.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype` (exact: every
    value is an FP4 code times a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
                         f"blocks must be [..., G, {MXFP4_BLOCK // 2}] over scales [..., G]")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: even, odd
    values = lut[codes].flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N] float -> (blocks, scales) with each block's scale the smallest power of two that fits
    its largest magnitude under 6 (the largest code), values rounded to the nearest code. For
    checkpoint fixtures and dummy weights; quantising dequantised values gives those values back."""
    if x.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of {MXFP4_BLOCK}, got {x.shape[-1]}")
    xb = x.float().reshape(*x.shape[:-1], -1, MXFP4_BLOCK)
    amax = xb.abs().amax(-1).clamp(min=2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = xb / torch.exp2(exp)[..., None]
    lut = torch.tensor(FP4_E2M1_VALUES[:8], dtype=torch.float32, device=x.device)
    mag = (scaled.abs()[..., None] - lut).abs().argmin(-1)  # nearest magnitude code 0..7
    codes = (mag | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def resolve_mxfp4_experts(checkpoint_mxfp4: bool, quantization: str | None, device: torch.device,
                          moe_backend: str | None) -> bool:
    """Keep an MXFP4 checkpoint's routed experts MXFP4 (the Triton kernel dequantises in its K loop)?
    quantization=None (auto): on CUDA with the Triton backend available and not overridden; "mxfp4":
    wherever it runs (elsewhere the expert layer dequantises per call: slow, for tests); "none":
    never (dequantised to the model dtype at load)."""
    if quantization == "mxfp4" and not checkpoint_mxfp4:
        raise ValueError("quantization='mxfp4' needs an MXFP4 checkpoint (config.json quantization_config with "
                         "quant_method 'mxfp4', as gpt-oss's); online quantisation is not supported")
    if not checkpoint_mxfp4 or quantization == "none":
        return False
    if quantization == "mxfp4":
        return True
    if device.type != "cuda" or "triton" not in kernels.available_backends(device) or \
            moe_backend not in (None, "triton"):
        logger.info("MXFP4 checkpoint: routed experts are dequantised at load (MXFP4 experts need CUDA and the "
                    "Triton backend; device=%s, moe_backend=%s)", device, moe_backend)
        return False
    logger.info("MXFP4 checkpoint: routed experts stay MXFP4 (Triton kernel)")
    return True
