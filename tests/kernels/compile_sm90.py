"""Compiles the GPU-only branches of the decode kernels (L2 prefetch, PDL) for an H100/H200
(sm_90) on a machine without a GPU, and prints as JSON, per kernel with the prefetch on and off,
how many bulk L2 prefetches and PDL waits its PTX holds and whether the first prefetch comes
before the wait. Run it in a process without TRITON_INTERPRET (under the interpreter nothing is
compiled):

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

SM90 = GPUTarget("cuda", 90, 32)
CASES = {
    # kernel, its constexprs (PREFETCH added), pointer element types other than bf16, float scalars
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
