"""MXFP4 (OCP microscaling FP4) weight tiles, dequantised in registers for the expert GEMMs.

A weight matrix [N, Kd] is held as `q` uint8 [N, Kd/2] (two FP4 E2M1 codes a byte: the low nibble
is the even column, the high nibble the odd one) and `s` uint8 [N, Kd/32] (one E8M0 scale per 32
columns): w = e2m1(code) * 2^(s - 127), the layout of gpt-oss's hub checkpoints with each row's
[Kd/32, 16] blocks flattened to Kd/2 bytes. Hopper has no FP4 tensor cores, so the GEMMs load the
4.25-bit tiles and turn them into the activation dtype here, then run the 16-bit MMA.

The dequantisation is exact and equals kernels.reference_mxfp4 (and models.mxfp4) bit for bit on
every byte and every scale 0..255, subnormal and infinite results included:
- a code's sign, two exponent bits and mantissa bit go straight into fp32's sign, lowest exponent
  bits and top mantissa bit ((c << 28 | c << 22), masked): the code's value times 2^-126 (0.5
  becomes an fp32 subnormal), which a multiply by 2^127 makes twice the value, exactly;
- the scale becomes 2^(s - 128) in fp32 (its exponent field s - 1, or the subnormals 2^-128 and
  2^-127 for s = 0, 1), so that 2 * value * 2^(s - 128) never forms an out-of-range factor (2^128,
  s = 255, would be one), and the product, of at most two significant bits, is exact;
- bf16 is then the top half of the fp32 bits (exact, no rounding: 2 significant bits), fp16 a cast.
This needs fp32 multiplies that keep subnormals: on the GPU Triton emits mul.f32 without .ftz
(tests/kernels/compile_sm90_mxfp4.py checks); under TRITON_INTERPRET the kernels run in numpy on the
calling thread, which keeps them unless something turned on FTZ/DAZ for the process (kernels/cpu_native
is linked so as not to).

For bf16 activations on CUDA the tiles take a packed form (`_packed_bf16`, inline PTX; the default,
MOE_MXFP4_UPCAST=packed; =fp32 the form above): the same values from a few 32-bit integer ops and two
fma.rn.bf16x2 a byte, two weights a register instead of one fp32 value each. The bf16 bits of
value * 2^-126 are placed directly (the same trick in bf16's exponent, which has fp32's range), then
multiplied by 2^127 and by the scale 2^(s - 128) in bf16, exactly (at most two significant bits; bf16
fma keeps subnormals). Fewer ALU instructions a weight: 5-20% off the layer from 64 tokens on, where the
dequantisation bounds it (BENCHMARKS.md §1, MXFP4).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MXFP4_BLOCK = 32
UPCASTS = ("fp32", "packed")
_UPCAST = os.environ.get("MOE_MXFP4_UPCAST", "packed")
if _UPCAST not in UPCASTS:
    raise ValueError(f"MOE_MXFP4_UPCAST={_UPCAST!r}: expected one of {', '.join(UPCASTS)}")
# inline PTX runs on CUDA only: never under the interpreter
PACKED_UPCAST = tl.constexpr(_UPCAST == "packed" and os.environ.get("TRITON_INTERPRET", "0") != "1")

# Four bytes ($4) and their four scales ($5..$8: bf16 bits of 2^(s-128) in both halves) -> the low
# nibbles' bf16 values ($0, $1: two a register) and the high nibbles' ($2, $3). Each byte spreads to a
# 16-bit lane (prmt), a nibble's sign goes to bit 15 and its exponent and mantissa bits to bits 8..6
# (value * 2^-126), then * 2^127 (0x7F00) and * the scale of its byte (pairs of scales by prmt); + -0
# keeps -0.
_PACKED_BF16_ASM = tl.constexpr("""
{
.reg .b32 z, nz, c127, w01, w23, t0, t1, s01, s23;
mov.b32 z, 0;
mov.b32 nz, 0x80008000;
mov.b32 c127, 0x7F007F00;
prmt.b32 w01, $4, z, 0x4140;
prmt.b32 w23, $4, z, 0x4342;
prmt.b32 s01, $5, $6, 0x7610;
prmt.b32 s23, $7, $8, 0x7610;
shl.b32 t0, w01, 12; and.b32 t0, t0, 0x80008000; shl.b32 t1, w01, 6; and.b32 t1, t1, 0x01C001C0;
or.b32 $0, t0, t1;
shl.b32 t0, w23, 12; and.b32 t0, t0, 0x80008000; shl.b32 t1, w23, 6; and.b32 t1, t1, 0x01C001C0;
or.b32 $1, t0, t1;
shl.b32 t0, w01, 8; and.b32 t0, t0, 0x80008000; shl.b32 t1, w01, 2; and.b32 t1, t1, 0x01C001C0;
or.b32 $2, t0, t1;
shl.b32 t0, w23, 8; and.b32 t0, t0, 0x80008000; shl.b32 t1, w23, 2; and.b32 t1, t1, 0x01C001C0;
or.b32 $3, t0, t1;
fma.rn.bf16x2 $0, $0, c127, nz; fma.rn.bf16x2 $0, $0, s01, nz;
fma.rn.bf16x2 $1, $1, c127, nz; fma.rn.bf16x2 $1, $1, s23, nz;
fma.rn.bf16x2 $2, $2, c127, nz; fma.rn.bf16x2 $2, $2, s01, nz;
fma.rn.bf16x2 $3, $3, c127, nz; fma.rn.bf16x2 $3, $3, s23, nz;
}
""")


@triton.jit
def _packed_bf16(q, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """q uint8 [BLOCK_N, BLOCK_K/2], s uint8 [BLOCK_N, BLOCK_K/32] -> bf16 [BLOCK_N, BLOCK_K] (inline PTX)."""
    s = s.to(tl.uint32)
    s16 = tl.where(s >= 2, (s - 1) << 7, 0x20 << s)  # bf16 bits of 2^(s-128)
    s_pair = tl.broadcast_to((s16 | (s16 << 16))[:, :, None], (BLOCK_N, BLOCK_K // 32, 16))
    lo, hi = tl.inline_asm_elementwise(
        _PACKED_BF16_ASM, "=r,=r,=r,=r,r,r,r,r,r",
        [q, tl.reshape(s_pair, (BLOCK_N, BLOCK_K // 2))], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return tl.interleave(lo, hi)  # low nibble = even column


@triton.jit
def _e2m1_times_two(c):
    """E2M1 codes (uint32 nibbles 0..15) -> 2 * their value, fp32 (exact)."""
    # c << 28 | c << 22 (no carries: c < 16), masked: the sign to fp32's, the exponent bits e and
    # mantissa bit b to fp32's lowest exponent and top mantissa bits: value * 2^-126 (e = 0: an fp32
    # subnormal), then * 2^127, exact in IEEE fp32
    bits = (c * 0x10400000) & 0x81C00000
    return bits.to(tl.float32, bitcast=True) * 1.7014118346046923e38  # 2^127


@triton.jit
def mxfp4_to(q, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    """q uint8 [BLOCK_N, BLOCK_K/2], s uint8 [BLOCK_N, BLOCK_K/32] -> [BLOCK_N, BLOCK_K] in DTYPE."""
    if PACKED_UPCAST and DTYPE == tl.bfloat16:
        return _packed_bf16(q, s, BLOCK_N, BLOCK_K)
    q = q.to(tl.uint32)
    v = tl.interleave(_e2m1_times_two(q & 15), _e2m1_times_two(q >> 4))  # low nibble = even column
    s = s.to(tl.uint32)
    scale = tl.where(s >= 2, (s - 1) << 23, 0x200000 << s).to(tl.float32, bitcast=True)  # 2^(s-128)
    v = tl.reshape(tl.reshape(v, (BLOCK_N, BLOCK_K // 32, 32)) * scale[:, :, None], (BLOCK_N, BLOCK_K))
    if DTYPE == tl.bfloat16:  # exact: every value has at most two significant bits
        return (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(DTYPE)


@triton.jit
def load_mxfp4_scales(s_ptrs, k_left, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K/32] E8M0 scales of one K step at s_ptrs; k_left: the weight columns left
    from this step on (a multiple of 32; <= 0: past the end, nothing read)."""
    return tl.load(s_ptrs, mask=(tl.arange(0, BLOCK_K // 32) * 32 < k_left)[None, :], other=127)


@triton.jit
def load_mxfp4_t(q_ptrs, s, k_left, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, DTYPE: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] B operand (W^T) of one K step: its bytes at q_ptrs [BLOCK_N, BLOCK_K/2]
    and its scales `s` (load_mxfp4_scales), dequantised; k_left as there."""
    if EVEN_K:
        q = tl.load(q_ptrs)
    else:  # masked bytes are code 0: zero whatever the scale
        q = tl.load(q_ptrs, mask=(tl.arange(0, BLOCK_K // 2) < k_left // 2)[None, :], other=0)
    return tl.trans(mxfp4_to(q, s, BLOCK_N, BLOCK_K, DTYPE))


@triton.jit
def load_mxfp4_codes(q_ptrs, k_left, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The raw [BLOCK_N, BLOCK_K/2] code bytes of one K step (MXFP4_SCALED); k_left as in load_mxfp4_t."""
    if EVEN_K:
        return tl.load(q_ptrs)
    return tl.load(q_ptrs, mask=(tl.arange(0, BLOCK_K // 2) < k_left // 2)[None, :], other=0)


@triton.jit
def dot_mxfp4_scaled(a, q, s, acc, A_FORMAT: tl.constexpr):
    """acc + a @ W^T for W's code bytes q [BLOCK_N, BLOCK_K/2] and scales s [BLOCK_N, BLOCK_K/32]
    through tl.dot_scaled: the compiler's own E2M1 upcast instead of mxfp4_to's, to the same
    values. A_FORMAT: a's dtype as dot_scaled names it, "bf16" or "fp16" (the upcast's target)."""
    return tl.dot_scaled(a, None, A_FORMAT, tl.trans(q), s, "e2m1", acc)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, o_ptr, N, Kd, stride_qn, stride_sn, stride_on,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    nmask = (offs_n < N)[:, None]
    qk = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    sk = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    q = tl.load(q_ptr + offs_n[:, None].to(tl.int64) * stride_qn + qk[None, :],
                mask=nmask & (qk < Kd // 2)[None, :], other=0)
    s = tl.load(s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + sk[None, :],
                mask=nmask & (sk < Kd // 32)[None, :], other=127)
    w = mxfp4_to(q, s, BLOCK_N, BLOCK_K, o_ptr.dtype.element_ty)
    ok = k0 + tl.arange(0, BLOCK_K)
    tl.store(o_ptr + offs_n[:, None].to(tl.int64) * stride_on + ok[None, :], w,
             mask=nmask & (ok < Kd)[None, :])


def dequantize_mxfp4_triton(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                            block_n: int = 32, block_k: int = 128) -> torch.Tensor:
    """q uint8 [..., Kd/2], s uint8 [..., Kd/32] -> [..., Kd] in `dtype` (bf16, fp16 or fp32),
    through the GEMMs' own tile dequantisation (:func:`mxfp4_to`): for tests and one-off
    conversions."""
    *lead, kb = q.shape
    Kd = 2 * kb
    if tuple(s.shape) != (*lead, Kd // MXFP4_BLOCK) or Kd % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 q {tuple(q.shape)} and s {tuple(s.shape)} do not match: q must be "
                         f"[..., Kd/2] over s [..., Kd/32], Kd a multiple of {MXFP4_BLOCK}")
    q2, s2 = q.reshape(-1, kb).contiguous(), s.reshape(-1, Kd // MXFP4_BLOCK).contiguous()
    N = q2.shape[0]
    out = torch.empty(N, Kd, dtype=dtype, device=q.device)
    if N and Kd:
        grid = (triton.cdiv(N, block_n), triton.cdiv(Kd, block_k))
        _dequant_kernel[grid](q2, s2, out, N, Kd, q2.stride(0), s2.stride(0), out.stride(0),
                              BLOCK_N=block_n, BLOCK_K=block_k)
    return out.view(*lead, Kd)
