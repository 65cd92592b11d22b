"""Compiles the decode kernels' GPU-only branches (L2 prefetch, PDL) for an H100/H200 (sm_90) on
a machine without a GPU, and prints per kernel how many bulk L2 prefetches and PDL waits its PTX
holds, and whether the first prefetch comes before the wait, with the prefetch on and off, as JSON. Run in a process without TRITON_INTERPRET (under
the interpreter the kernels are not compiled at all):

    python tests/kernels/compile_sm90.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root
from kernels.triton_attention.decode import _decode_split_kernel  # noqa: E402
from kernels.triton_fused.skinny_gemm import _skinny_kernel  # noqa: E402
from kernels.triton_moe.gemm import down_kernel, gate_up_kernel  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
EXPERTS = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, GN=1, GK=1, USE_FP8=False, EVEN_K=True,
               PRECISION="tf32", UPCAST=False, USE_PDL=True)
CASES = {
    # kernel, its constexprs (PREFETCH added), pointer element types other than bf16, float scalars
    "gate_up": (gate_up_kernel, EXPERTS,
                {"sorted_ptr": "i32", "expert_ids_ptr": "i32", "npp_ptr": "i32",
                 "xs_ptr": "fp32", "ws_ptr": "fp32", "hs_ptr": "fp32"}, ()),
    "down": (down_kernel, {**EXPERTS, "SPLIT_K": 1, "ATOMIC": False},
             {"sorted_ptr": "i32", "expert_ids_ptr": "i32", "npp_ptr": "i32", "topk_w_ptr": "fp32",
              "hs_ptr": "fp32", "ws_ptr": "fp32"}, ()),
    "skinny": (_skinny_kernel, dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048, USE_DOT=False, IS_SPLIT=False,
                                    HAS_BIAS=False, EVEN_K=True, EVEN_N=True, INTERPRET=False, USE_PDL=True),
               {"ws_ptr": "fp32"}, ()),
    "decode_attention": (_decode_split_kernel,
                         dict(HG=8, HG_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK_N=64, S=16, NUM_SPLITS=3,
                              USE_CHUNK=False, FUSED_MERGE=True, PRECISION="tf32", UPCAST=False, USE_PDL=True,
                              LANES=128),
                         {"bt_ptr": "i32", "seq_lens_ptr": "i32", "part_o_ptr": "fp32", "part_lse_ptr": "fp32",
                          "counter_ptr": "i32"}, ("scale_log2",)),
}


def compile_ptx(kernel, constexprs: dict, pointer_types: dict, floats: tuple) -> str:
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointer_types.get(name, "bf16")
        else:
            signature[name] = "fp32" if name in floats else "i32"
    return triton.compile(ASTSource(kernel, signature, constexprs), target=SM90).asm["ptx"]


def main() -> None:
    report = {}
    for name, (kernel, constexprs, pointer_types, floats) in CASES.items():
        for prefetch in (True, False):
            ptx = compile_ptx(kernel, {**constexprs, "PREFETCH": prefetch}, pointer_types, floats)
            first_prefetch = ptx.find("cp.async.bulk.prefetch.L2.global")
            report[f"{name}/prefetch_{'on' if prefetch else 'off'}"] = {
                "bulk_prefetches": ptx.count("cp.async.bulk.prefetch.L2.global"),
                "pdl_waits": ptx.count("griddepcontrol.wait"),
                "prefetch_before_wait": 0 <= first_prefetch < ptx.find("griddepcontrol.wait")}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
