"""An oracle of TRITON_INTERPRET's float32 -> float8_e4m3fn cast, so that FP8 kernels can be
checked tightly on the CPU.

The interpreter rounds the mantissa to 3 bits (to nearest) but ORs the carry into the exponent:
where the biased exponent is odd, a value whose rounding crosses a power of two (124.6 -> 128)
comes out as the power of two below it (64) instead; results below 2^-6 (subnormal) are then
truncated toward zero onto the 2^-9 grid (measured on this Triton). tests/kernels/test_triton_moe.py
checks this oracle against the interpreter itself, so a Triton release that fixes the cast fails
that test loudly.
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
MIN_NORMAL = 2.0 ** -6  # below it e4m3 is subnormal: a fixed step, no exponent to carry into
SUBNORMAL_STEP = 2.0 ** -9


def interpreter_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (float32, already clamped to +-448) cast as the Triton interpreter casts it."""
    x = x.float()
    mag = x.abs()
    exp = torch.floor(torch.log2(mag.clamp(min=2.0 ** -30)))
    frac = torch.round((mag / torch.exp2(exp) - 1) * 8)  # 3 mantissa bits, to nearest
    # A mantissa carry is OR-ed into the biased exponent's low bit: right when that bit is 0,
    # lost when it is 1 (and below the normal range).
    carry = frac == 8
    biased = exp + 7
    kept = carry & (biased >= 1) & (torch.remainder(biased, 2) == 0)
    frac = torch.where(carry, torch.zeros_like(frac), frac)
    exp = torch.where(kept, exp + 1, exp)
    v = torch.exp2(exp) * (1 + frac / 8)
    v = torch.where(v < MIN_NORMAL, torch.floor(v / SUBNORMAL_STEP) * SUBNORMAL_STEP, v)  # truncated
    return (torch.sign(x) * torch.where(mag > 0, v, torch.zeros_like(v))).to(E4M3)


def interpreter_qdq_groups(x_TD: torch.Tensor, group: int) -> torch.Tensor:
    """kernels.reference_fp8._qdq_groups with the interpreter's cast (same scales)."""
    from kernels.reference_fp8 import FP8_MAX

    T, D = x_TD.shape
    G = -(-D // group)
    xp = torch.nn.functional.pad(x_TD.float(), (0, G * group - D)).view(T, G, group)
    s = xp.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    q = interpreter_e4m3((xp / s).clamp(-FP8_MAX, FP8_MAX)).float() * s
    return q.view(T, G * group)[:, :D]
