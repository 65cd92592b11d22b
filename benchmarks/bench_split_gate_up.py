"""Split-K gate_up (the config's top-level "SPLIT_K") for steps of a few tokens, on one GPU.

At one token a layer touches K experts, and gate_up has K x F / BLOCK_N tiles that each loop over
all of D: fewer programs than SMs, each a long chain of dependent loads. Splitting D over n
programs (partial sums added into fp32, then one launch for the bias and the activation) puts n
times the loads in flight. Per shape and M: the expert layer's µs with the config in use as it is
(shipped, or the default) and with gate_up split 2 / 4 / 8, each beside the down GEMM as configured
and with its F range split 2 / 4 (fp32 atomics); the relative error of each against the unsplit
call; the best, and its speed-up. Timing as the tuner's: CUDA-graph replay of one call, median, four
routings replayed in turn so that consecutive calls touch other experts.

    python benchmarks/bench_split_gate_up.py [--shapes qwen3-30b-a3b gpt-oss-20b gpt-oss-120b] [--M 1 2 4 8]
        [--out benchmarks/results/split_gate_up.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

SHAPES = {  # name: (E, D, F, top-k, weights)
    "qwen3-30b-a3b": (128, 2048, 768, 8, "bf16"),
    "gpt-oss-20b": (32, 2880, 2880, 4, "mxfp4"),
    "gpt-oss-120b": (128, 2880, 2880, 4, "mxfp4"),
    "deepseek-v3": (256, 7168, 2048, 8, "bf16"),
}
UP_SPLITS = [1, 2, 4, 8]
DOWN_SPLITS = [None, 2, 4]  # None: the down GEMM as configured


def variants(base: dict) -> list[tuple[str, dict]]:
    out = []
    for up in UP_SPLITS:
        for down in DOWN_SPLITS:
            cfg = {k: v for k, v in base.items() if k != "SPLIT_K"}
            cfg["down"] = dict(base.get("down", {}))
            if up > 1:
                cfg["SPLIT_K"] = up
            if down is not None:
                cfg["down"].update(SPLIT_K=down, ATOMIC_SUM=True)
            out.append((f"up{up}/down{down or 'as-is'}", cfg))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES)[:3], choices=list(SHAPES))
    parser.add_argument("--M", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    from kernels.triton_moe.config import device_name, get_config
    from kernels.triton_moe.fused import _run
    from kernels.triton_moe.tune import make_problem, time_calls

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": time.strftime("%Y%m%d-%H%M%S"), "argv": sys.argv, "rows": []}
    for shape in args.shapes:
        E, D, F, K, weights = SHAPES[shape]
        g = torch.Generator(device="cuda").manual_seed(0)
        if weights == "mxfp4":  # random codes; scales 2^-8 .. 2^-6 (weights of the size of D^-0.5)
            q13 = torch.randint(0, 256, (E, 2 * F, D // 2), device="cuda", dtype=torch.uint8, generator=g)
            q2 = torch.randint(0, 256, (E, D, F // 2), device="cuda", dtype=torch.uint8, generator=g)
            s13 = torch.randint(119, 122, (E, 2 * F, D // 32), device="cuda", dtype=torch.uint8, generator=g)
            s2 = torch.randint(119, 122, (E, D, F // 32), device="cuda", dtype=torch.uint8, generator=g)
            b13 = torch.randn(E, 2 * F, device="cuda", generator=g).to(torch.bfloat16)
            b2 = (torch.randn(E, D, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
            extra = dict(mxfp4=(s13, s2), w13_bias=b13, w2_bias=b2, activation="swigluoai")
            w13, w2 = q13, q2
        else:
            _, w13, w2, _, _ = make_problem(E, D, F, K, 1, torch.bfloat16)
            extra = {}
        for M in args.M:
            problems = [make_problem(E, D, F, K, M, torch.bfloat16, with_weights=False, seed=s) for s in range(4)]
            base = get_config(M, E, F, K, weights if weights == "mxfp4" else torch.bfloat16)
            row = {"shape": shape, "M": M, "E": E, "D": D, "F": F, "K": K, "weights": weights,
                   "config_in_use": base, "us": {}, "rel_err": {}}
            x, _, _, tw, ti = problems[0]
            want = _run(x, w13, w2, tw, ti, None, base, **extra).float()
            for name, cfg in variants(base):
                try:
                    got = _run(x, w13, w2, tw, ti, None, cfg, **extra).float()
                    row["rel_err"][name] = float((got - want).norm() / want.norm())
                    fns = [lambda p=p, cfg=cfg: _run(p[0], w13, w2, p[3], p[4], None, cfg, **extra) for p in problems]
                    row["us"][name] = round(time_calls(fns, reps=20) * 1e3, 2)
                except Exception as e:  # out of resources etc.
                    row["us"][name] = f"{type(e).__name__}: {str(e)[:120]}"
            timed = {k: v for k, v in row["us"].items() if isinstance(v, float)}
            as_is = timed.get("up1/downas-is")
            best = min(timed, key=timed.get)
            row.update(best=best, best_us=timed[best], as_is_us=as_is, speedup=as_is / timed[best] if as_is else None)
            print(json.dumps({k: row[k] for k in ("shape", "M", "as_is_us", "best", "best_us", "speedup")}),
                  flush=True)
            results["rows"].append(row)
            torch.cuda.empty_cache()
    results["device_name_key"] = device_name()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
