"""The tiled Triton GEMM (kernels/triton_fused/dense_gemm.py) against F.linear (cuBLAS) and, up to
16 rows, the skinny GEMM, at the decode batch sizes of the dense projections, on one GPU.

Legend: M rows of x (batch), N output features, K input features.

    python benchmarks/bench_dense_gemm.py --out results/dense_gemm_h200.json [--models qwen3 llama4]
        [--ms 4 8 16 32 64 128 256] [--sweep small|full]
    python benchmarks/bench_dense_gemm.py --device cpu --tiny      # smoke run (TRITON_INTERPRET=1)

Timing as in bench_skinny.py: back-to-back calls captured in one CUDA graph over copies of W that
together exceed 2x the L2, replayed, time / calls (a decode graph's launches, W from HBM). The
sweep's configs run beside dense_config's choice; every output is checked against F.linear within
the fp32-accumulation bound (a mismatch aborts the run). floor_us is W's bytes at 4.8 TB/s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root

from benchmarks.bench_skinny import HBM_BYTES_PER_S, Timer, check, cold_calls, fmt, linear_bound, linear_shapes  # noqa: E402


SMEM_BYTES = 220 * 1024  # the tiles' buffers (stages + 1, as Triton allocates them) within an H200 SM's 227 KiB


def sweep_configs(M: int, N: int, K: int, level: str) -> list:
    """dense_config's choice first, then the tiles to try (deduplicated)."""
    import triton

    from kernels.triton_fused.dense_gemm import DenseConfig, dense_config

    base = dense_config(M, N, K)
    configs = [base]
    if level == "tiny":
        return configs + [DenseConfig(16, 16, 32, 2), DenseConfig(32, 32, 16)]
    bm0 = min(64, max(16, triton.next_power_of_2(M)))
    block_ms = [bm0] + ([128] if M >= 128 else []) + ([32] if level == "full" and bm0 == 64 else [])
    k_steps_max = triton.cdiv(K, 64)
    for bm in block_ms:
        for bn in (32, 64, 128):
            for bk in (64, 128):
                for split in (1, 2, 4) if level == "small" else (1, 2, 4, 8):
                    if split > 1 and triton.cdiv(K, bk) < 2 * split or split > k_steps_max:
                        continue
                    warps = 8 if bm * bn >= 64 * 128 else 4
                    stages = (4,) if level == "small" else (3, 4, 5)
                    configs += [DenseConfig(bm, bn, bk, split, warps, s) for s in stages
                                if (bm + bn) * bk * 2 * (s + 1) <= SMEM_BYTES]
    seen, out = set(), []
    for c in configs:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def bench_linear(torch, timer, model, layer, N, K, M, level, device):
    import torch.nn.functional as F

    from kernels.triton_fused.dense_gemm import dense_linear
    from kernels.triton_fused.skinny_gemm import MAX_M, skinny_linear

    g = torch.Generator(device="cpu").manual_seed(N * 7 + K + M)
    w = (0.05 * torch.randn(N, K, generator=g)).to(torch.bfloat16).to(device)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(device)
    ref = F.linear(x, w)
    bound = linear_bound(torch, x, w)
    name = f"{model} {layer} M={M} N={N} K={K}"
    cublas_calls, copies = cold_calls(torch, w, x, F.linear)
    n = len(cublas_calls)
    row = {"model": model, "layer": layer, "M": M, "N": N, "K": K, "weight_MB": N * K * 2 / 1e6,
           "floor_us": N * K * 2 / HBM_BYTES_PER_S * 1e6, "calls_per_graph": n,
           "cublas_graph_us": timer.graph_us(cublas_calls), "tolerance": bound.max().item(), "sweep": []}
    if M <= MAX_M:
        check(torch, f"{name} skinny", skinny_linear(x, w), ref, bound)
        row["skinny_graph_us"] = timer.graph_us([lambda i=i: skinny_linear(x, copies[i % len(copies)])
                                                 for i in range(n)])
    for i, cfg in enumerate(sweep_configs(M, N, K, level)):
        def call(xx, ww, cfg=cfg):
            return dense_linear(xx, ww, config=cfg)
        check(torch, f"{name} {cfg}", call(x, w), ref, bound)
        entry = {"config": cfg._asdict(),
                 "graph_us": timer.graph_us([lambda i=i: call(x, copies[i % len(copies)]) for i in range(n)])}
        check(torch, f"{name} {cfg} (after timing)", call(x, w), ref, bound)
        if i == 0:
            row["heuristic_config"], row["dense_graph_us"] = cfg._asdict(), entry["graph_us"]
        row["sweep"].append(entry)
    timed = [e for e in row["sweep"] if e["graph_us"] is not None]
    best = min(timed, key=lambda e: e["graph_us"]) if timed else row["sweep"][0]
    row["best_config"], row["best_graph_us"] = best["config"], best["graph_us"]
    if row["cublas_graph_us"] is not None:
        row["speedup_heuristic"] = row["cublas_graph_us"] / row["dense_graph_us"]
        row["speedup_best"] = row["cublas_graph_us"] / row["best_graph_us"]
    return row


def config_str(c):
    return f"m{c['block_m']} n{c['block_n']} k{c['block_k']} s{c['split_k']} w{c['num_warps']} st{c['num_stages']}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: correctness only, under TRITON_INTERPRET=1 (use with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and sweep: a smoke run")
    parser.add_argument("--models", nargs="+", default=["qwen3"], choices=["qwen3", "deepseek", "llama4"])
    parser.add_argument("--layers", nargs="*", default=None, help="only these layers (e.g. 'o_proj tp1')")
    parser.add_argument("--ms", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128, 256], help="rows M")
    parser.add_argument("--sweep", choices=["small", "full"], default="small", help="configs tried")
    parser.add_argument("--budget-s", type=float, default=None, help="stop sweeping new rows after this long")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_dense_gemm.py needs a GPU (or --device cpu --tiny)")
    timer = Timer(torch, args.device)
    if args.tiny:
        shapes, ms, level = [("tiny", "a", 48, 64), ("tiny", "b", 20, 100)], [5, 17], "tiny"
    else:
        shapes = [s for s in linear_shapes(args.models) if s[1] != "router"]  # the router: the fused gate
        if args.layers:
            shapes = [s for s in shapes if s[1] in args.layers]
        ms, level = args.ms, args.sweep
    start = time.time()
    rows = []
    print(f"{'model':<14}{'layer':<16}{'M':>4}{'N':>7}{'K':>7}{'floor':>7}{'cuBLAS':>8}{'skinny':>8}{'dense':>8}"
          f"{'best':>8}  best config", flush=True)
    with torch.no_grad():
        for model, layer, N, K in shapes:
            for M in ms:
                if args.budget_s is not None and time.time() - start > args.budget_s:
                    print(f"budget spent: {model} {layer} M={M} and later rows not run", flush=True)
                    break
                r = bench_linear(torch, timer, model, layer, N, K, M, level, args.device)
                rows.append(r)
                print(f"{model:<14}{layer:<16}{M:>4}{N:>7}{K:>7}{r['floor_us']:>7.2f}{fmt(r['cublas_graph_us']):>8}"
                      f"{fmt(r.get('skinny_graph_us')):>8}{fmt(r['dense_graph_us']):>8}{fmt(r['best_graph_us']):>8}"
                      f"  {config_str(r['best_config'])}  [{time.time() - start:.0f} s]", flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print(f"all outputs within tolerance; {time.time() - start:.0f} s")
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
                "torch": torch.__version__, "dtype": "bf16", "sweep": level, "times": "microseconds per call"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "linear": rows}, f, indent=1)


if __name__ == "__main__":
    main()
