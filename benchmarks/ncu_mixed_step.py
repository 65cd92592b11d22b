"""A Qwen3-30B-A3B mixed step's heaviest kernels, run so that Nsight Compute (ncu) can read their hardware
counters (DRAM throughput, occupancy, warp stalls), on a CUDA GPU:

    experts M   the expert layer at M tokens with the shipped config, three times, then cuBLAS bmm on the
                same rows spread evenly over the experts (gate_up's and down's shapes), twice
    attention   a mixed step's attention: 255 decode rows at ~540 context and one 512-token chunk over 1000
                cached tokens, decode rows apart (the split-KV decode kernel, then the unified kernel), three times

Profile the third call's kernels (the first two compile and warm up), e.g.:

    ncu --clock-control none --kernel-name regex:"gate_up_kernel|down_kernel|nvjet" --launch-skip 4 \\
        --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats python3 benchmarks/ncu_mixed_step.py experts 768
    ncu ... --kernel-name regex:"unified|decode" ... python3 benchmarks/ncu_mixed_step.py attention

(`gpu_run.sh ncu` runs both at 768 and 2048 tokens.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def experts(M: int) -> None:
    import torch

    from kernels.triton_moe.config import get_config
    from kernels.triton_moe.fused import _run
    from kernels.triton_moe.tune import make_problem

    E, D, F, K = 128, 2048, 768, 8
    x, w13, w2, tw, ti = make_problem(E, D, F, K, M, torch.bfloat16)
    cfg = get_config(M, E, F, K, torch.bfloat16)
    print("config", cfg, flush=True)
    for _ in range(3):
        _run(x, w13, w2, tw, ti, None, cfg)
    rows = max(1, M * K // E)
    a = torch.randn(E, rows, D, dtype=x.dtype, device=x.device)
    h = torch.randn(E, rows, F, dtype=x.dtype, device=x.device)
    for _ in range(2):
        torch.bmm(a, w13.transpose(1, 2))
        torch.bmm(h, w2.transpose(1, 2))
    torch.cuda.synchronize()


def attention() -> None:
    import torch
    from bench_attention import D, mixed_case

    from kernels.triton_attention.unified import unified_attention_triton

    (q, cache, tables, qsl, lens), _, _ = mixed_case(torch, 255, 540, 512, 1000)
    out = torch.empty_like(q)
    for _ in range(3):
        unified_attention_triton(q, cache, tables, qsl, lens, D ** -0.5, out_THd=out, decodes_apart=True)
    torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("experts").add_argument("M", type=int)
    sub.add_parser("attention")
    args = p.parse_args()
    experts(args.M) if args.what == "experts" else attention()


if __name__ == "__main__":
    main()
