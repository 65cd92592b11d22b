"""Compiles the MXFP4 expert GEMMs (kernels/triton_moe/gemm.py with W_MXFP4) for an H100/H200 (sm_90)
on a machine without a GPU, at gpt-oss's shapes (D = F = 2880: K not a multiple of BLOCK_K 128) and
the decode / mid / prefill default configs, and prints as JSON per variant: whether it compiled,
which MMA the dot became (wgmma or mma.sync, bf16 operands), how many asynchronous global-to-shared
copies the K loop issues (the pipelined operands: the activations and the weight bytes, not the
scales, which are too narrow a load and are fetched a step ahead by hand), whether any fp32 multiply
flushes subnormals (the exact dequantisation needs none to), whether the tiles took the packed bf16
upcast (MOE_MXFP4_UPCAST, read at import), and ptxas's registers and spill bytes.
The launches are specialised as the JIT launcher would specialise real ones (16-byte aligned
pointers, ints equal to 1 as constants, ints divisible by 16 marked so). Run it in a process
without TRITON_INTERPRET (under the interpreter nothing is compiled):

    python tests/kernels/compile_sm90_mxfp4.py [--configs decode mid prefill] [--activations bf16]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root
from kernels.triton_moe.gemm import down_kernel, gate_up_kernel  # noqa: E402

# kernels/triton_moe/config.py's default_config buckets: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages)
CONFIGS = {"decode": (16, 64, 128, 1, 4, 3), "mid": (64, 64, 64, 1, 4, 3), "prefill": (128, 128, 64, 8, 8, 3)}
E, D, F, TOP_K = 32, 2880, 2880, 4  # gpt-oss-20b
DO_NOT_SPECIALIZE = {"num_valid", "num_m_blocks"}


def _launch_ints(which: str, mxfp4: bool) -> dict:
    """The integer arguments fused._run passes for contiguous gpt-oss tensors."""
    if which == "gate_up":
        kb = D // 2 if mxfp4 else D  # weight row length in elements (MXFP4: bytes)
        return dict(N=F, Kd=D, top_k=TOP_K, stride_gum=2 * F, stride_xm=D, stride_xk=1, stride_we=2 * F * kb,
                    stride_wn=kb,
                    stride_wk=1, stride_hm=F, stride_hn=1, stride_xsm=0, stride_xsk=0,
                    stride_wse=2 * F * D // 32 if mxfp4 else 0, stride_wsn=D // 32 if mxfp4 else 0,
                    stride_wsk=1 if mxfp4 else 0, stride_hsm=0, stride_hsk=0, stride_be=2 * F, stride_bn=1)
    kb = F // 2 if mxfp4 else F
    return dict(N=D, Kd=F, top_k=TOP_K, stride_hm=F, stride_hk=1, stride_we=D * kb, stride_wn=kb, stride_wk=1,
                stride_om=D, stride_on=1, stride_hsm=0, stride_hsk=0,
                stride_wse=D * F // 32 if mxfp4 else 0, stride_wsn=F // 32 if mxfp4 else 0,
                stride_wsk=1 if mxfp4 else 0, stride_be=D, stride_bn=1)


def specialise(kernel, constexprs: dict, pointers: dict, ints: dict, floats=lambda name: name.startswith("swiglu"),
               plain_ints=DO_NOT_SPECIALIZE):
    """(signature, constexprs, attrs) as the JIT launcher would build them: pointers 16-byte aligned,
    ints == 1 as constexprs, ints divisible by 16 marked so (`plain_ints`, the kernel's
    do_not_specialize ones: plain i32); `floats(name)`: the fp32 arguments."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    constexprs, signature, attrs = dict(constexprs), {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(i,)] = BaseBackend.parse_attr("D")
        elif floats(name):
            signature[name] = "fp32"
        elif name in plain_ints:
            signature[name] = "i32"
        else:
            ty, key = native_specialize_impl(BaseBackend, ints[name], False, True, True)
            if ty == "constexpr":
                constexprs[name] = key
                signature[name] = "constexpr"
            else:
                signature[name] = ty
                attrs[(i,)] = BaseBackend.parse_attr(key)
    return signature, constexprs, attrs


def compile_variant(which: str, config: str, act: str = "bf16", bias: bool = True,
                    activation: str = "swigluoai", split_k: int = 1, mxfp4: bool = True,
                    scaled: bool = False, half_tiles: bool = False, swap_ab: bool = False) -> dict:
    """One GEMM compiled for sm_90 (mxfp4=False: the same launch with `act` weights, to compare;
    scaled: the MXFP4 tiles through tl.dot_scaled, MOE_MXFP4_DOT_SCALED; half_tiles: HALF_TILES;
    split_k: SPLIT_K, gate_up's into fp32 partial sums, down's with the atomic top-k sum; swap_ab: SWAP_AB)."""
    bm, bn, bk, gm, warps, stages = CONFIGS[config]
    kd = D if which == "gate_up" else F
    constexprs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, GN=1, GK=1, USE_FP8=False,
                      EVEN_K=kd % bk == 0, PRECISION="tf32", UPCAST=False, USE_PDL=True, HAS_BIAS=bias,
                      W_MXFP4=mxfp4, MXFP4_SCALED=act if mxfp4 and scaled else "", HALF_TILES=half_tiles,
                      SWAP_AB=swap_ab)
    pointers = {"w_ptr": "u8" if mxfp4 else act, "ws_ptr": "u8" if mxfp4 else act, "sorted_ptr": "i32",
                "expert_ids_ptr": "i32", "npp_ptr": "i32", "b_ptr": "fp32", "topk_w_ptr": "fp32",
                "xs_ptr": act, "hs_ptr": act}
    if which == "gate_up":
        kernel = gate_up_kernel
        constexprs["ACTIVATION"] = activation
        pointers.update(x_ptr=act, h_ptr=act)
        constexprs["SPLIT_K"] = split_k
        if split_k > 1:  # partial sums into a fp32 [P, 2F]
            pointers["gu_ptr"] = "fp32"
        else:
            constexprs["gu_ptr"] = None
    else:
        kernel = down_kernel
        atomic = split_k > 1
        constexprs.update(SPLIT_K=split_k, ATOMIC=atomic, TMA=False)
        pointers.update(h_ptr=act, out_ptr="fp32" if atomic else act)
    if not bias:
        constexprs["b_ptr"] = None
    signature, constexprs, attrs = specialise(kernel, constexprs, pointers, _launch_ints(which, mxfp4))
    compiled, log = compile_sm90(ASTSource(kernel, signature, constexprs, attrs),
                                 {"num_warps": warps, "num_stages": stages})
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    loop = ttgir[ttgir.index("scf.for"):]
    loop = loop[:loop.index("scf.yield")]
    mma = re.findall(r"(wgmma\.mma_async[\w.]*|mma\.sync\.aligned[\w.]*)", ptx)
    report = {"compiled": True, "mma": sorted(set(mma)), "ftz_f32_mul": bool(re.search(r"mul(\.rn)?\.ftz\.f32", ptx)),
              # kernels/triton_moe/mxfp4.py's _packed_bf16: its 2^127 pair (tl.dot_scaled has bf16x2 fmas too)
              "packed_upcast": "0x7f007f00" in ptx.lower(),
              "shared_bytes": compiled.metadata.shared,
              "async_copies_in_loop": loop.count("ttg.async_copy_global_to_local"),
              # shared-memory tiles made inside the K loop (a dequantised tile turned into an MMA operand there)
              "local_allocs_in_loop": loop.count("ttg.local_alloc")}
    report.update(ptxas_usage(log))
    return report


def compile_sm90(src, options: dict):
    """(the compiled kernel, ptxas's -v log): compiled afresh (no cache hit) for sm_90, Triton printing
    its own ptxas run's log (its flags, not ours)."""
    log = io.StringIO()
    knobs = triton.knobs
    with knobs.nvidia.scope(), knobs.compilation.scope():
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled, log.getvalue()


def ptxas_usage(log: str) -> dict:
    """Registers and spill bytes from the `ptxas -v` log of Triton's own ptxas run."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spills.group(1)) if spills else None}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["decode", "prefill"], choices=list(CONFIGS))
    p.add_argument("--activations", nargs="+", default=["bf16"], choices=["bf16", "fp16"])
    p.add_argument("--scaled", action="store_true",
                   help="also compile each MXFP4 launch through tl.dot_scaled (MOE_MXFP4_DOT_SCALED)")
    p.add_argument("--with-16bit-weights", action="store_true",
                   help="also compile each launch with 16-bit weights (W_MXFP4 off), to compare")
    p.add_argument("--half-tiles", action="store_true", help="compile the launches with HALF_TILES")
    p.add_argument("--swap-ab", action="store_true", help="compile the MXFP4 launches with SWAP_AB")
    a = p.parse_args(argv)
    report = {}
    for act in a.activations:
        for cfg in a.configs:
            forms = [(True, False)] + ([(True, True)] if a.scaled else []) + ([(False, False)] if a.with_16bit_weights
                                                                              else [])
            for mx, scaled in forms:
                tag = ("mxfp4_scaled" if scaled else "mxfp4") if mx else act
                half = {"half_tiles": a.half_tiles, "swap_ab": a.swap_ab and mx and not scaled}
                report[f"gate_up/{cfg}/{act}/{tag}"] = compile_variant("gate_up", cfg, act, mxfp4=mx, scaled=scaled,
                                                                      **half)
                report[f"down/{cfg}/{act}/{tag}"] = compile_variant("down", cfg, act, mxfp4=mx, scaled=scaled,
                                                                   split_k=2 if cfg == "decode" else 1, **half)
                if cfg == "decode":  # gate_up's D range split (SPLIT_K), for steps of a few tokens
                    report[f"gate_up_split4/{cfg}/{act}/{tag}"] = compile_variant(
                        "gate_up", cfg, act, mxfp4=mx, scaled=scaled, split_k=4, **half)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
