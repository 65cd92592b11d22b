"""The few-token expert path (kernels/triton_moe/skinny.py: gate_up rows + down with the top-k sum,
two launches) against the grouped path (align, gate_up, down, moe_sum with the tuned config) at
decode batch sizes, on one GPU.

Legend: T tokens, D hidden, F expert intermediate (per rank), E experts, K top-k.

    python benchmarks/bench_skinny_experts.py --out results/skinny_experts_h200.json [--ts 1 2 4]
    python benchmarks/bench_skinny_experts.py --device cpu --tiny      # smoke run (interpreter)

Shapes (bf16): Qwen3-30B-A3B (E=128, D=2048, F=768, K=8), the same at TP=2 (F=384) and Llama-4
Scout (E=16, D=5120, F=8192, K=1). Each timing is CALLS calls captured in one CUDA graph and
replayed (launch overhead excluded, as in the engine's decode graphs), time / CALLS; every call
has its own random routing, so the experts it reads are (mostly) not in the L2, as in a decode
step where 48 layers' weights pass through it. floor_us: the bytes of the experts one call
touches at 4.8 TB/s. Every timed output is checked against the torch reference first.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

CALLS = 64
HBM_BYTES_PER_S = 4.8e12
SHAPES = [("qwen3-30b-a3b", 128, 2048, 768, 8), ("qwen3-30b-a3b tp2", 128, 2048, 384, 8),
          ("llama4-scout", 16, 5120, 8192, 1)]
TINY = [("tiny", 6, 40, 24, 4)]


def sweep(D, F, level):
    from kernels.triton_moe.skinny import skinny_expert_config

    base = skinny_expert_config(D, F)
    if level == "tiny":
        return [base, base._replace(up_block_n=4, up_block_k=16, down_block_n=8, down_block_k=16)]
    out = [base, base._replace(num_warps=8), base._replace(num_warps=2)]
    for up_n, up_k in ((1, 1024), (2, 1024), (2, 2048), (4, 512)):
        out.append(base._replace(up_block_n=up_n, up_block_k=min(up_k, D)))
    for dn, dk in ((2, 1024), (8, 512), (4, 512), (8, 256), (16, 256)):
        out.append(base._replace(down_block_n=dn, down_block_k=dk))
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def graph_us(torch, fns, cuda):
    if not cuda:
        for f in fns[:2]:
            f()
        return None
    from triton.testing import do_bench
    for f in fns[:2]:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    us = do_bench(g.replay, warmup=5, rep=40, return_mode="median") * 1e3 / len(fns)
    del g
    return us


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run")
    p.add_argument("--ts", type=int, nargs="+", default=[1, 2, 3, 4])
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    import torch

    from kernels.reference import fused_experts_torch
    from kernels.triton_moe import fused_experts_triton
    from kernels.triton_moe.config import get_config
    from kernels.triton_moe.skinny import fused_experts_skinny

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("bench_skinny_experts.py needs a GPU (or --device cpu --tiny)")
    dev, dtype = args.device, torch.bfloat16
    shapes, level = (TINY, "tiny") if args.tiny else (SHAPES, "small")
    ts = [1, 3] if args.tiny else args.ts
    calls = 2 if args.tiny else CALLS
    rows, start = [], time.time()
    print(f"{'shape':<20}{'T':>3}{'floor':>8}{'grouped':>9}{'skinny':>9}{'best':>9}  best config", flush=True)
    with torch.no_grad():
        for name, E, D, F, K in shapes:
            g = torch.Generator().manual_seed(E + D)
            w13 = (torch.randn(E, 2 * F, D, generator=g) * D ** -0.5).to(dtype).to(dev)
            w2 = (torch.randn(E, D, F, generator=g) * F ** -0.5).to(dtype).to(dev)
            for T in ts:
                x = torch.randn(T, D, generator=g).to(dtype).to(dev)
                routes = []
                for _ in range(calls):
                    tw, ti = torch.softmax(torch.randn(T, E, generator=g), -1).topk(K, dim=-1)
                    routes.append((tw.to(dev), ti.to(torch.int32).to(dev)))
                tw, ti = routes[0]
                ref = fused_experts_torch(x, w13, w2, tw, ti).float()

                def rel(out):
                    return ((out.float() - ref).norm() / ref.norm()).item()

                touched = len(set(ti.flatten().tolist()))
                row = {"shape": name, "E": E, "D": D, "F": F, "K": K, "T": T, "experts_touched_call0": touched,
                       "floor_us": touched * 3 * D * F * 2 / HBM_BYTES_PER_S * 1e6, "sweep": []}
                cfg = get_config(T, E, F, K, dtype)
                row["grouped_rel_err"] = rel(fused_experts_triton(x, w13, w2, tw, ti, config=cfg))
                row["grouped_us"] = graph_us(torch, [lambda r=r: fused_experts_triton(x, w13, w2, *r, config=cfg)
                                                     for r in routes], cuda)
                for c in sweep(D, F, level):
                    err = rel(fused_experts_skinny(x, w13, w2, tw, ti, config=c))
                    if err > 2e-2:
                        raise SystemExit(f"MISMATCH {name} T={T} {c}: rel err {err:.3e}")
                    us = graph_us(torch, [lambda r=r, c=c: fused_experts_skinny(x, w13, w2, *r, config=c)
                                          for r in routes], cuda)
                    row["sweep"].append({"config": c._asdict(), "us": us, "rel_err": err})
                row["skinny_us"] = row["sweep"][0]["us"]
                best = min(row["sweep"], key=lambda e: e["us"] if e["us"] is not None else 0)
                row["best_us"], row["best_config"] = best["us"], best["config"]
                rows.append(row)

                def f(v):
                    return "-" if v is None else f"{v:.2f}"
                print(f"{name:<20}{T:>3}{row['floor_us']:>8.2f}{f(row['grouped_us']):>9}{f(row['skinny_us']):>9}"
                      f"{f(row['best_us']):>9}  {best['config']}  [{time.time() - start:.0f} s]", flush=True)
            if cuda:
                torch.cuda.empty_cache()
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "torch": torch.__version__,
                "dtype": "bf16", "calls_per_graph": calls, "times": "microseconds per call (graph replay)"}
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
