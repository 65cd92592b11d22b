"""Pieces shared by the fused kernels: rounding casts that are exact under the interpreter too,
and input checks."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 `x` rounded to `dtype` to nearest-even, as torch's `.to(dtype)`.

    The CPU interpreter (triton 3.9) truncates fp32 -> bf16, so there the rounding is done by
    hand on the bits (add half an ulp of bf16, ties to even, then drop the low 16 bits); the
    cast that follows is then exact. On the GPU the cast itself rounds to nearest-even.
    """
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its last dimension is contiguous (the kernels take any other strides),
    else a contiguous copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {n: t.device for n, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors on different devices: {devices}")
