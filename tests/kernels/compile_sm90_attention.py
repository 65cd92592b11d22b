"""Compiles the paged-attention kernels that read key tiles through attend_context (varlen prefill and
unified) for an H100/H200 (sm_90) on a machine without a GPU, with the launch configs they ship with at
Qwen3-30B-A3B's attention shape (32 query heads over 4 KV heads, head dim 128, blocks of 16, bf16), the
key tiles' block-table reads one tile ahead (BLOCK_PREFETCH, the default) and in the tile's own step,
and prints as JSON per variant: ptxas's registers and spill bytes, the dynamic shared memory, how many
block-table loads the kernel holds, and how many K/V tile copies the key loops leave in flight while a
tile computes (the largest `num` of their async waits). The launches are specialised as the JIT launcher
would specialise real ones (16-byte aligned pointers, ints equal to 1 as constants, ints divisible by 16
marked so). Run it in a process without TRITON_INTERPRET (under the interpreter nothing is compiled):

    python tests/kernels/compile_sm90_attention.py
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import triton.language as tl
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_sm90_mxfp4 import compile_sm90, ptxas_usage, specialise  # noqa: E402

from kernels.triton_attention import common, prefill, unified  # noqa: E402
from kernels.triton_attention.common import heads_per_program  # noqa: E402

H, G, D, S = 32, 4, 128, 16
FLAGS = dict(HEAD_DIM=D, D_PAD=D, S=S, USE_CHUNK=False, USE_WINDOW=False, USE_SINKS=False, PRECISION="tf32",
             UPCAST=False, USE_PDL=True, SCALE_V=False)
POINTERS = {"q_ptr": "bf16", "kv_ptr": "bf16", "o_ptr": "bf16", "bt_ptr": "i32", "qsl_ptr": "i32",
            "seq_lens_ptr": "i32", "sinks_ptr": "fp32"}
# What a launch at this shape passes (strides in elements of contiguous q / out [T, H, d] and cache
# [2, N, S, G, d] with N = 4096 blocks; the block-table row stride a multiple of 16).
INTS = dict(stride_qt=H * D, stride_qh=D, stride_ot=H * D, stride_oh=D, stride_btb=64, stride_btm=1,
            v_offset=4096 * S * G * D, stride_blk=S * G * D, stride_tok=G * D, chunk_size=1, window=1, B=257)


def loop_report(kernel, constexprs: dict, options: dict) -> dict:
    """One kernel compiled for sm_90 with the launch's constexprs and options: its JSON entry."""
    signature, constexprs, attrs = specialise(kernel, constexprs, POINTERS, INTS,
                                              floats=lambda name: name in ("scale_log2", "v_scale"),
                                              plain_ints=("B", "stride_btb"))
    compiled, log = compile_sm90(ASTSource(kernel, signature, constexprs, attrs), options)
    ttgir = compiled.asm["ttgir"]
    waits = [int(n) for n in re.findall(r"ttg\.async_wait[^{]*\{num = (\d+)", ttgir)]
    report = {"copies_in_flight": max(waits, default=0), "shared_bytes": compiled.metadata.shared,
              "loads": ttgir.count("tt.load ")}
    report.update(ptxas_usage(log))
    return report


def main() -> None:
    hg = H // G
    block_q = unified.default_block_q(hg)
    hpp = heads_per_program(H, G, cap=16)
    cfg = prefill._launch_config(8192, hpp, D)  # one 8192-token prompt
    report = {}
    for ahead in (True, False):
        common.BLOCK_PREFETCH = tl.constexpr(ahead)  # read when the kernel is compiled
        tag = "ahead" if ahead else "in_step"
        report[f"unified/{tag}"] = loop_report(
            unified._unified_kernel,
            dict(FLAGS, HG=hg, BQ=block_q, BLOCK_M=unified.tile_rows(block_q, hg), BLOCK_N=64, SKIP_DECODES=True,
                 INVARIANT=False),
            {"num_warps": 4, "num_stages": 2})
        report[f"prefill/{tag}"] = loop_report(
            prefill._prefill_kernel,
            dict(FLAGS, HG=hg, HPP=hpp, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"]),
            {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
