"""Fused Triton kernels (kernels/triton_fused) against the torch compositions they replace, at
Qwen3-30B-A3B shapes (D=2048, H=32, G=4, d=128, E=128, K=8, bf16) on one GPU.

Legend: T tokens, D hidden, H query heads, G key heads, d head dim, E experts, K top-k.

    python benchmarks/bench_fused.py --out results/fused_h200.json [--tokens 1 256 8192]

Cases: rms_norm (D), rms_norm + residual, rope (q and k), qk_norm + rope (Qwen3 attention),
softmax_topk (renormalised). For T <= 256 each side is timed as a CUDA graph holding REPEAT
back-to-back copies of the op (as inside a decode step's graph, where every kernel costs its
launch gap), divided by REPEAT; above, triton.testing.do_bench medians of eager calls. The
torch side is the modules' own torch code (their `use_triton_fused` gates forced off).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

D, H, G, HEAD_DIM, E, K = 2048, 32, 4, 128, 128, 8
EPS = 1e-6
MAX_POS = 40960
REPEAT = 20
GRAPH_MAX_T = 256


@contextlib.contextmanager
def fused_gates(on: bool):
    """Force the modules' Triton gates on or off."""
    import models.layers.norm as norm_mod
    import models.layers.rotary as rotary_mod
    import routing.router as router_mod

    mods = (norm_mod, rotary_mod, router_mod)
    saved = [m.use_triton_fused for m in mods]
    for m in mods:
        m.use_triton_fused = lambda x, on=on: on
    try:
        yield
    finally:
        for m, f in zip(mods, saved):
            m.use_triton_fused = f


def time_us(torch, do_bench, fn, T):
    """Microseconds per call of fn: graph replay of REPEAT copies for small T, else eager."""
    fn()
    torch.cuda.synchronize()
    if T > GRAPH_MAX_T:
        return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn()
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3 / REPEAT


def make_cases(torch, T, dev="cuda"):
    """name -> (callable under the current gates, description of its inputs)."""
    from models.config import RopeConfig
    from models.layers.norm import RMSNorm
    from models.layers.rotary import get_rope
    from routing.router import softmax_topk

    bf16 = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(T)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(bf16)

    norm = RMSNorm(D, EPS).to(dev, bf16)
    q_norm, k_norm = RMSNorm(HEAD_DIM, EPS).to(dev, bf16), RMSNorm(HEAD_DIM, EPS).to(dev, bf16)
    with torch.no_grad():
        for n in (norm, q_norm, k_norm):
            n.weight.copy_(1 + 0.3 * randn(n.weight.shape[0]))
    rope = get_rope(HEAD_DIM, MAX_POS, RopeConfig(theta=1e6)).to(dev)
    x, residual = randn(T, D), randn(T, D)
    qkv = randn(T, (H + 2 * G) * HEAD_DIM)
    q, k, _ = qkv.split([H * HEAD_DIM, G * HEAD_DIM, G * HEAD_DIM], -1)
    q, k = q.reshape(T, H, HEAD_DIM), k.reshape(T, G, HEAD_DIM)  # strided views, as attention gets them
    positions = torch.randint(0, MAX_POS, (T,), generator=g, device=dev)
    logits = randn(T, E)
    return {
        "rms_norm": lambda: norm(x),
        "rms_norm+residual": lambda: norm(x, residual),
        "rope": lambda: rope(positions, q, k),
        "qk_norm+rope": lambda: rope.forward_with_qk_norm(positions, q, k, q_norm, k_norm),
        "softmax_topk": lambda: softmax_topk(logits, K, True),
    }


def max_abs_diff(torch, a, b):
    if isinstance(a, torch.Tensor):
        return (a.float() - b.float()).abs().max().item()
    if hasattr(a, "topk_weights_TK"):
        return max_abs_diff(torch, a.topk_weights_TK, b.topk_weights_TK)
    return max(max_abs_diff(torch, x, y) for x, y in zip(a, b))


def bench(torch, do_bench, T):
    rows = []
    with torch.no_grad():
        cases = make_cases(torch, T)
        for name, fn in cases.items():
            with fused_gates(False):
                ref = fn()
                t_torch = time_us(torch, do_bench, fn, T)
            with fused_gates(True):
                out = fn()
                t_triton = time_us(torch, do_bench, fn, T)
            rows.append({"case": name, "T": T, "triton_us": t_triton, "torch_us": t_torch,
                         "speedup": t_torch / t_triton, "max_abs_diff": max_abs_diff(torch, out, ref),
                         "timing": "graph" if T <= GRAPH_MAX_T else "eager"})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 8192], help="token counts T")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root

    import torch
    from triton.testing import do_bench

    if not torch.cuda.is_available():
        raise SystemExit("bench_fused.py needs a GPU")
    rows = []
    for T in args.tokens:
        rows += bench(torch, do_bench, T)
        torch.cuda.empty_cache()
    print(f"{'case':<20}{'T':>6}{'timing':>8}{'triton us':>11}{'torch us':>10}{'speedup':>9}{'max diff':>10}")
    for r in rows:
        print(f"{r['case']:<20}{r['T']:>6}{r['timing']:>8}{r['triton_us']:>11.2f}{r['torch_us']:>10.2f}"
              f"{r['speedup']:>9.2f}{r['max_abs_diff']:>10.2e}")
    # One decoder layer of Qwen3-MoE uses: 2 residual norms, the q/k norm + rope and the router.
    per_layer = ("rms_norm+residual", "rms_norm+residual", "qk_norm+rope", "softmax_topk")
    for T in args.tokens:
        by_case = {r["case"]: r for r in rows if r["T"] == T}
        fused = sum(by_case[c]["triton_us"] for c in per_layer)
        unfused = sum(by_case[c]["torch_us"] for c in per_layer)
        print(f"per layer at T={T}: fused {fused:.1f} us, torch {unfused:.1f} us ({unfused - fused:.1f} us saved)")
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "repeat_in_graph": REPEAT,
                "shape": {"D": D, "H": H, "G": G, "d": HEAD_DIM, "E": E, "K": K, "dtype": "bf16"}}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
