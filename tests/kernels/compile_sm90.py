"""Compiles split-KV decode attention for an H100/H200 (sm_90) on a machine without a GPU, with its
L2 prefetch on and off, and prints as JSON how many bulk L2 prefetches and PDL waits each PTX holds
and whether the first prefetch comes before the wait. Run it in a process without TRITON_INTERPRET
(under the interpreter nothing is compiled):

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

# Qwen3-30B-A3B's decode shape: 8 query heads per KV head, head dim 128, blocks of 16, 3 splits.
CONSTEXPRS = dict(HG=8, HG_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK_N=64, S=16, NUM_SPLITS=3, USE_CHUNK=False,
                  FUSED_MERGE=True, PRECISION="tf32", UPCAST=False, USE_PDL=True, LANES=128, MIXED=False,
                  USE_WINDOW=False, USE_SINKS=False)
POINTERS = {"q_ptr": "bf16", "kv_ptr": "bf16", "o_ptr": "bf16", "bt_ptr": "i32", "seq_lens_ptr": "i32",
            "part_o_ptr": "fp32", "part_lse_ptr": "fp32", "counter_ptr": "i32", "qsl_ptr": "i32",
            "sinks_ptr": "fp32"}


def decode_ptx(prefetch: bool) -> str:
    constexprs = dict(CONSTEXPRS, PREFETCH=prefetch)
    signature = {name: "constexpr" if name in constexprs else
                 "*" + POINTERS[name] if name in POINTERS else
                 "fp32" if name == "scale_log2" else "i32"
                 for name in _decode_split_kernel.arg_names}
    return triton.compile(ASTSource(_decode_split_kernel, signature, constexprs),
                          target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def main() -> None:
    report = {}
    for prefetch in (True, False):
        ptx = decode_ptx(prefetch)
        first_prefetch = ptx.find("cp.async.bulk.prefetch.L2.global")
        report[f"decode_attention/prefetch_{'on' if prefetch else 'off'}"] = {
            "bulk_prefetches": ptx.count("cp.async.bulk.prefetch.L2.global"),
            "pdl_waits": ptx.count("griddepcontrol.wait"),
            "prefetch_before_wait": 0 <= first_prefetch < ptx.find("griddepcontrol.wait")}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
