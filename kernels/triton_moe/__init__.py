"""Triton grouped-GEMM expert layer (the ``backend="triton"`` of ``kernels.fused_experts``).

align.py   token alignment (sort by expert, pad to BLOCK_M) on the GPU, no host sync
gemm.py    gate_up (SiLU*up fused) and down (routed weight fused) grouped GEMM kernels,
           optionally with expert biases and gpt-oss's clamped SwiGLU ("swigluoai")
quant.py   per-token-group FP8 activation quantisation
mxfp4.py   MXFP4 weight tiles dequantised in registers (the GEMMs' W_MXFP4 form)
fused.py   the launchers: fused_experts_triton, fused_experts_triton_fp8, fused_experts_triton_mxfp4
config.py  tuned config files (kernels/configs/) and defaults
tune.py    the tuner (`python -m kernels.triton_moe.tune`, `moe tune-moe`)
"""
from kernels.triton_moe.align import align_tokens, align_tokens_torch
from kernels.triton_moe.fused import (fused_experts_triton, fused_experts_triton_fp8,
                                     fused_experts_triton_mxfp4)

__all__ = ["fused_experts_triton", "fused_experts_triton_fp8", "fused_experts_triton_mxfp4",
           "align_tokens", "align_tokens_torch"]
