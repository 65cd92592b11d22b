"""Compiles the 16-bit down GEMM (Qwen3-30B-A3B's expert shape) for an H100/H200 (sm_90) on a machine
without a GPU, with its tiles loaded by pointer and through TMA descriptors (config "TMA" under
"down"), and prints as JSON per form the bulk tensor copies (TMA), per-thread async copies and
wgmma instructions of its PTX, its shared memory, registers and spills. Run it in a process without
TRITON_INTERPRET (under the interpreter nothing is compiled):

    python tests/kernels/compile_sm90_down_tma.py
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root
from compile_sm90_mxfp4 import compile_sm90, ptxas_usage, specialise  # noqa: E402

from kernels.triton_moe.gemm import down_kernel  # noqa: E402

E, D, F, TOP_K = 128, 2048, 768, 8
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages): the H200 file's mid-size down tiles
TILE = (64, 128, 64, 8, 4, 3)


def compile_down(tma: bool) -> dict:
    bm, bn, bk, gm, warps, stages = TILE
    constexprs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, GN=1, GK=1, USE_FP8=False, EVEN_K=True,
                      PRECISION="tf32", UPCAST=False, USE_PDL=True, HAS_BIAS=False, b_ptr=None, SPLIT_K=1,
                      ATOMIC=False, W_MXFP4=False, MXFP4_SCALED="", HALF_TILES=False, SWAP_AB=False, TMA=tma)
    pointers = {name: "bf16" for name in ("h_ptr", "w_ptr", "out_ptr", "hs_ptr", "ws_ptr")}
    pointers.update(sorted_ptr="i32", expert_ids_ptr="i32", npp_ptr="i32", topk_w_ptr="fp32")
    ints = dict(N=D, Kd=F, top_k=TOP_K, stride_hm=F, stride_hk=1, stride_we=D * F, stride_wn=F, stride_wk=1,
                stride_om=D, stride_on=1, stride_hsm=0, stride_hsk=0, stride_wse=0, stride_wsn=0, stride_wsk=0,
                stride_be=D, stride_bn=1)
    signature, constexprs, attrs = specialise(down_kernel, constexprs, pointers, ints)
    if tma:  # host-side descriptors, as fused.tma_descriptors makes them
        signature.update(h_ptr=f"tensordesc<bf16[{bm}, {bk}]>", w_ptr=f"tensordesc<bf16[{bn}, {bk}]>")
        described = {down_kernel.arg_names.index("h_ptr"), down_kernel.arg_names.index("w_ptr")}
        attrs = {k: v for k, v in attrs.items() if k[0] not in described}
    compiled, log = compile_sm90(ASTSource(down_kernel, signature, constexprs, attrs),
                                 {"num_warps": warps, "num_stages": stages})
    ptx = compiled.asm["ptx"]
    report = {"bulk_tensor_copies": ptx.count("cp.async.bulk.tensor"),
              "async_copies": len(re.findall(r"cp\.async\.c[ag]\.", ptx)),
              "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)), "shared_bytes": compiled.metadata.shared}
    report.update(ptxas_usage(log))
    return report


if __name__ == "__main__":
    print(json.dumps({"pointers": compile_down(False), "tma": compile_down(True)}))
