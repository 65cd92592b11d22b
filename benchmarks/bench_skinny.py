"""Skinny GEMM (kernels/triton_fused/skinny_gemm.py) against F.linear (cuBLAS) at decode batch
sizes, and moe_sum (kernels/triton_fused/moe_sum.py) against torch's `.sum(dim=1)`, on one GPU.

Legend: M rows of x (batch), N output features, K input features; T tokens, K top-k, D hidden.

    python benchmarks/bench_skinny.py --out results/skinny_h200.json \
        [--models qwen3 deepseek llama4] [--ms 1 2 4 8 16] [--sweep none|small|full]
    python benchmarks/bench_skinny.py --device cpu --tiny      # smoke run (TRITON_INTERPRET=1)

The full default run (3 models x 5 M x ~14 configs, each compiled once) may take several
minutes; split it with --models (one model per command) if a command has a time limit.

Linear shapes (bf16 weights [N, K]): Qwen3-30B-A3B at TP=1 and TP=2, DeepSeek-V3 (MLA
projections, router, shared expert; q_b / kv_b / o_proj at TP=8) from moe/bench/common.py, and
Llama-4 Scout's dense layers. For every (shape, M):
- graph: CALLS back-to-back calls captured in one CUDA graph, replayed, time / CALLS (as the
  engine runs them: launch overhead excluded). The calls cycle through copies of W that
  together exceed 2x the L2 (50 MiB on an H200), so W comes from HBM as it does in a decode
  step where 48 layers' weights pass through the L2; small W gets more calls for that;
- event: triton.testing.do_bench of one eager call (L2 flushed between calls, launch included);
- cuBLAS (F.linear), skinny_linear with skinny_config's choice, and a sweep of other configs
  (graph timing only; the best one is reported).
Every timed output is checked against F.linear elementwise within the fp32-accumulation bound
of tests/kernels/test_triton_skinny.py; a mismatch aborts the run. floor_us is W's bytes at
4.8 TB/s.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPEAT = 20  # calls per graph (more for small W, see cold_calls)
COLD_BYTES = 128 * 2 ** 20  # > 2x the H200's L2: weights cycled through this much are read from HBM
MAX_CALLS = 512
HBM_BYTES_PER_S = 4.8e12
MOE_K, MOE_D = 8, 2048

# Llama-4 Scout's text config (the dims that matter): hidden 5120, 40 query / 8 key heads of
# 128, shared expert of 8192, 16 experts (moe/bench/kernel.py's SHAPES).
LLAMA4_SCOUT = {"hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                "intermediate_size": 8192, "num_local_experts": 16}


def linear_shapes(models: list[str]) -> list[tuple[str, str, int, int]]:
    """(model, layer, N, K) of the dense linears a decode step runs at M = batch rows."""
    from moe.bench.common import DEEPSEEK_V3 as ds
    from moe.bench.common import QWEN3_30B_A3B as qw

    shapes = []
    if "qwen3" in models:
        D, H, G, d = qw["hidden_size"], qw["num_attention_heads"], qw["num_key_value_heads"], qw["head_dim"]
        for tp in (1, 2):
            shapes += [("qwen3-30b-a3b", f"qkv_proj tp{tp}", (H + 2 * G) * d // tp, D),
                       ("qwen3-30b-a3b", f"o_proj tp{tp}", D, H * d // tp)]
        shapes.append(("qwen3-30b-a3b", "router", qw["num_experts"], D))
    if "deepseek" in models:
        D, H = ds["hidden_size"], ds["num_attention_heads"]
        qk = ds["qk_nope_head_dim"] + ds["qk_rope_head_dim"]
        shapes += [("deepseek-v3", "q_a_proj", ds["q_lora_rank"], D),
                   ("deepseek-v3", "kv_a_proj_with_mqa", ds["kv_lora_rank"] + ds["qk_rope_head_dim"], D),
                   ("deepseek-v3", "q_b_proj tp8", H // 8 * qk, ds["q_lora_rank"]),
                   ("deepseek-v3", "kv_b_proj tp8", H // 8 * (ds["qk_nope_head_dim"] + ds["v_head_dim"]),
                    ds["kv_lora_rank"]),
                   ("deepseek-v3", "o_proj tp8", D, H // 8 * ds["v_head_dim"]),
                   ("deepseek-v3", "router", ds["n_routed_experts"], D),
                   ("deepseek-v3", "shared gate_up", 2 * ds["moe_intermediate_size"], D),
                   ("deepseek-v3", "shared down", D, ds["moe_intermediate_size"])]
    if "llama4" in models:
        sc = LLAMA4_SCOUT
        D, H, G, d, F = sc["hidden_size"], sc["num_attention_heads"], sc["num_key_value_heads"], sc["head_dim"], \
            sc["intermediate_size"]
        shapes += [("llama4-scout", "qkv_proj", (H + 2 * G) * d, D), ("llama4-scout", "o_proj", D, H * d),
                   ("llama4-scout", "router", sc["num_local_experts"], D),
                   ("llama4-scout", "shared gate_up", 2 * F, D), ("llama4-scout", "shared down", D, F)]
    return shapes


def sweep_configs(M: int, N: int, K: int, level: str) -> list:
    """The heuristic's config first, then others to try (deduplicated, valid for the shape)."""
    import triton

    from kernels.triton_fused.skinny_gemm import SkinnyConfig, skinny_config

    base = skinny_config(M, N, K)
    configs = [base, base._replace(num_warps=8)]
    if level == "none":
        return configs[:1]
    kmax = max(16, triton.next_power_of_2(K))
    if level == "tiny":
        rows = [(8, 32)]
        dots = [(16, 32)]
        splits = (1, 3)
    elif level == "small":
        rows = [(1, 2048), (2, 1024), (2, 2048), (4, 1024)]
        dots = [(16, 256), (32, 128)]
        splits = (1, 4)
    else:
        rows = [(bn, bk) for bk in (512, 1024, 2048) for bn in (1, 2, 4, 8) if 2048 <= bn * bk <= 8192]
        dots = [(bn, bk) for bn in (16, 32) for bk in (64, 128, 256)]
        splits = (1, 2, 4, 8)
    for split in splits:
        if M <= 8:
            configs += [SkinnyConfig(bn, min(bk, kmax), split) for bn, bk in rows]
        configs += [SkinnyConfig(bn, min(bk, kmax), split, use_dot=True, num_stages=4) for bn, bk in dots]
    seen, out = set(), []
    for c in configs:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def linear_bound(torch, x, w):
    """Elementwise |y - F.linear| allowed: both are within the fp32-accumulation bound of the exact product
    (see tests/kernels/test_triton_skinny.py), so they are at most twice it apart."""
    xd, wd = x.double(), w.double()
    exact, magnitude = xd @ wd.T, xd.abs() @ wd.abs().T
    acc_err = (x.shape[1] + 1) * 2.0 ** -23 * magnitude  # u = 2^-24, doubled for tensor-core accumulation
    p = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}[x.dtype]
    _, e = torch.frexp(exact.abs() + acc_err)
    half_ulp = 0.5 * torch.ldexp(torch.ones_like(exact), e - p)
    return 2 * (acc_err + (half_ulp if x.dtype != torch.float32 else 0))


def check(torch, name, y, ref, bound):
    diff = (y.double() - ref.double()).abs()
    if y.isnan().any() or not (diff <= bound).all():
        raise SystemExit(f"MISMATCH in {name}: max |diff| {diff.max().item():.3e}, "
                         f"{int((diff > bound).sum())} elements over the bound")
    return diff.max().item()


class Timer:
    """Graph-replay and eager-event timings on CUDA; nothing on the CPU (smoke mode)."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device == "cuda"
        if self.cuda:
            from triton.testing import do_bench
            self.do_bench = do_bench

    def graph_us(self, calls):
        if not self.cuda:
            for c in calls:
                c()
            return None
        torch = self.torch
        for c in calls[:2]:
            c()  # compile and warm outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        us = self.do_bench(graph.replay, warmup=5, rep=25, return_mode="median") * 1e3 / len(calls)
        del graph
        return us

    def event_us(self, fn):
        if not self.cuda:
            fn()
            return None
        return self.do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def cold_calls(torch, w, x, fn):
    """Calls of fn(x, w_copy) over enough copies of w (and calls) that W is read from HBM each time;
    one call on the CPU (nothing is timed there)."""
    if not w.is_cuda:
        return [lambda: fn(x, w)], [w]
    w_bytes = w.numel() * w.element_size()
    n_calls = max(REPEAT, min(MAX_CALLS, math.ceil(COLD_BYTES / w_bytes)))
    copies = [w] + [w.clone() for _ in range(min(n_calls, max(2, math.ceil(COLD_BYTES / w_bytes))) - 1)]
    return [lambda i=i: fn(x, copies[i % len(copies)]) for i in range(n_calls)], copies


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def bench_linear(torch, timer, model, layer, N, K, M, level, device):
    import torch.nn.functional as F

    from kernels.triton_fused.skinny_gemm import skinny_linear

    g = torch.Generator(device="cpu").manual_seed(N * 7 + K + M)
    w = (0.05 * torch.randn(N, K, generator=g)).to(torch.bfloat16).to(device)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(device)
    ref = F.linear(x, w)
    bound = linear_bound(torch, x, w)
    name = f"{model} {layer} M={M} N={N} K={K}"
    cublas_calls, copies = cold_calls(torch, w, x, F.linear)
    row = {"model": model, "layer": layer, "M": M, "N": N, "K": K, "weight_MB": N * K * 2 / 1e6,
           "floor_us": N * K * 2 / HBM_BYTES_PER_S * 1e6, "calls_per_graph": len(cublas_calls),
           "cublas_graph_us": timer.graph_us(cublas_calls), "cublas_event_us": timer.event_us(lambda: F.linear(x, w)),
           "tolerance": bound.max().item(), "max_abs_diff": 0.0, "sweep": []}
    for i, cfg in enumerate(sweep_configs(M, N, K, level)):
        def call(xx, ww, cfg=cfg):
            return skinny_linear(xx, ww, config=cfg)
        diff = check(torch, f"{name} {cfg}", call(x, w), ref, bound)
        calls = [lambda i=i: call(x, copies[i % len(copies)]) for i in range(len(cublas_calls))]
        entry = {"config": cfg._asdict(), "graph_us": timer.graph_us(calls), "max_abs_diff": diff}
        diff = max(diff, check(torch, f"{name} {cfg} (after timing)", call(x, w), ref, bound))
        row["max_abs_diff"] = max(row["max_abs_diff"], diff)
        if i == 0:
            row["heuristic_config"] = cfg._asdict()
            row["skinny_graph_us"] = entry["graph_us"]
            row["skinny_event_us"] = timer.event_us(lambda: call(x, w))
        row["sweep"].append(entry)
    timed = [e for e in row["sweep"] if e["graph_us"] is not None]
    best = min(timed, key=lambda e: e["graph_us"]) if timed else row["sweep"][0]
    row["best_config"], row["best_graph_us"] = best["config"], best["graph_us"]
    if row["cublas_graph_us"] is not None:
        row["speedup_heuristic"] = row["cublas_graph_us"] / row["skinny_graph_us"]
        row["speedup_best"] = row["cublas_graph_us"] / row["best_graph_us"]
    return row


def bench_moe_sum(torch, timer, T, K, D, device):
    from kernels.triton_fused.moe_sum import moe_sum

    g = torch.Generator(device="cpu").manual_seed(T)
    y = torch.randn(T * K, D, generator=g).to(torch.bfloat16).to(device).view(T, K, D)
    ref = y.sum(dim=1)
    out = moe_sum(y)
    if not torch.equal(out, ref):  # fp32 sums of 8 bf16 values are exact here: rounding once must agree
        raise SystemExit(f"MISMATCH in moe_sum T={T} K={K} D={D}: max |diff| "
                         f"{(out.float() - ref.float()).abs().max().item():.3e}")
    row = {"T": T, "K": K, "D": D,
           "torch_graph_us": timer.graph_us([lambda: y.sum(dim=1)] * REPEAT),
           "triton_graph_us": timer.graph_us([lambda: moe_sum(y)] * REPEAT),
           "torch_event_us": timer.event_us(lambda: y.sum(dim=1)),
           "triton_event_us": timer.event_us(lambda: moe_sum(y))}
    if not torch.equal(moe_sum(y), ref):
        raise SystemExit(f"MISMATCH in moe_sum T={T} after timing")
    if row["torch_graph_us"] is not None:
        row["speedup_graph"] = row["torch_graph_us"] / row["triton_graph_us"]
    return row


def config_str(c):
    mode = "dot" if c["use_dot"] else "rows"
    return f"{mode} n{c['block_n']} k{c['block_k']} s{c['split_k']} w{c['num_warps']}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: correctness only, under TRITON_INTERPRET=1 (use with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and sweep: a smoke run")
    parser.add_argument("--models", nargs="+", default=["qwen3", "deepseek", "llama4"],
                        choices=["qwen3", "deepseek", "llama4"])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="rows M (<= 16)")
    parser.add_argument("--sweep", choices=["none", "small", "full"], default="small",
                        help="configs tried besides the heuristic's")
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=[1, 8, 32, 256], help="moe_sum token counts T")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_skinny.py needs a GPU (or --device cpu --tiny)")
    timer = Timer(torch, args.device)
    if args.tiny:
        shapes = [("tiny", "a", 48, 64), ("tiny", "b", 20, 100)]
        ms, level, moe_shapes = [1, 3], "tiny", [(1, MOE_K, 100), (3, MOE_K, 100)]
    else:
        shapes, ms, level = linear_shapes(args.models), args.ms, args.sweep
        moe_shapes = [(T, MOE_K, MOE_D) for T in args.moe_tokens]
    start = time.time()
    linear_rows, moe_rows = [], []
    print(f"{'model':<14}{'layer':<20}{'M':>3}{'N':>7}{'K':>7}{'floor':>7}{'cuBLAS':>8}{'skinny':>8}{'best':>8}"
          f"{'cuBLASev':>9}{'skinnyev':>9}  best config", flush=True)
    with torch.no_grad():
        for model, layer, N, K in shapes:
            for M in ms:
                r = bench_linear(torch, timer, model, layer, N, K, M, level, args.device)
                linear_rows.append(r)
                print(f"{model:<14}{layer:<20}{M:>3}{N:>7}{K:>7}{r['floor_us']:>7.2f}{fmt(r['cublas_graph_us']):>8}"
                      f"{fmt(r['skinny_graph_us']):>8}{fmt(r['best_graph_us']):>8}{fmt(r['cublas_event_us']):>9}"
                      f"{fmt(r['skinny_event_us']):>9}  {config_str(r['best_config'])}  [{time.time() - start:.0f} s]",
                      flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
        print(f"\n{'moe_sum T':<10}{'K':>3}{'D':>6}{'torch':>8}{'triton':>8}{'torchev':>9}{'tritonev':>9}")
        for T, K, D in moe_shapes:
            r = bench_moe_sum(torch, timer, T, K, D, args.device)
            moe_rows.append(r)
            print(f"{T:<10}{K:>3}{D:>6}{fmt(r['torch_graph_us']):>8}{fmt(r['triton_graph_us']):>8}"
                  f"{fmt(r['torch_event_us']):>9}{fmt(r['triton_event_us']):>9}", flush=True)
    print(f"all outputs within tolerance; {time.time() - start:.0f} s")
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
                "torch": torch.__version__, "dtype": "bf16", "calls_per_graph_min": REPEAT,
                "cold_bytes": COLD_BYTES, "sweep": level, "times": "microseconds per call"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "linear": linear_rows, "moe_sum": moe_rows}, f, indent=1)


if __name__ == "__main__":
    main()
