"""gpt-oss's expert layer with MXFP4 weights against bf16 weights of the same values, on one GPU.

The whole layer as the model runs it (alignment, gate_up with b13 and the clamped SwiGLU
"swigluoai", down with b2 and the routed weight, the top-k sum: kernels.triton_moe's
fused_experts_triton_mxfp4 / fused_experts_triton, their configs as shipped or defaulted), at
gpt-oss-20b (E=32) and gpt-oss-120b (E=128) shapes (D = F = 2880, top-4), M tokens per call.
Timing as `moe bench kernel` (moe/bench/kernel.py): CUDA-graph replay for M <= 1024, CUDA events
above (kernels/triton_moe/tune.py's time_calls), medians, several routings replayed in turn so that
consecutive calls touch other experts and the weights come from HBM, not the L2.

Per (shape, M) and weight format: µs, and the bytes floor: what the call must read at 4.8 TB/s
(weights of the experts touched: MXFP4 0.5 B + 1/32 B a weight, bf16 2 B; their biases; the
activations in and out), floor / time; also the FLOP floor (700 TFLOP/s, as moe bench kernel),
MXFP4's speed-up over bf16, and the errors (‖out − ref‖/‖ref‖) of both against the torch reference
on the dequantised weights (M <= --check-max-m) and of MXFP4 against bf16.

    python benchmarks/bench_mxfp4_experts.py [--shapes gpt-oss-20b gpt-oss-120b] [--M 1 8 ...]
        [--out benchmarks/results/mxfp4_experts_h200.json]
    python benchmarks/bench_mxfp4_experts.py --cpu-smoke [--swap-ab]  # tiny shapes, TRITON_INTERPRET=1, no GPU

The default run takes about two minutes on an H200 (compiles included).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

SHAPES = {  # name: (E, D, F, top-k)
    "gpt-oss-20b": (32, 2880, 2880, 4),
    "gpt-oss-120b": (128, 2880, 2880, 4),
}
SMOKE_SHAPES = {"smoke": (4, 64, 64, 2)}
SMOKE_CONFIG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1,
                "num_warps": 4, "num_stages": 1}
MS = [1, 8, 64, 256, 1024, 4096]
SMOKE_MS = [1, 8, 33]
HBM_BPS, PEAK_FLOPS = 4.8e12, 700e12
MXFP4_BYTES = 0.5 + 1 / 32  # a weight: half a byte of code, 1/32 of a scale byte
ROUTINGS = 8  # distinct routings replayed in turn (M <= 1024): 8 x 4 experts x 13 MB > 2x the L2


def make_weights(E, D, F, device, seed=0):
    """Random MXFP4 experts (codes uniform, scales 2^-8 .. 2^-6: weights of the size of D^-0.5) and
    bf16 biases; plus the bf16 weights of the same values."""
    import torch
    from kernels.reference_mxfp4 import dequantize_mxfp4
    g = torch.Generator(device=device).manual_seed(seed)
    q13 = torch.randint(0, 256, (E, 2 * F, D // 2), device=device, dtype=torch.uint8, generator=g)
    q2 = torch.randint(0, 256, (E, D, F // 2), device=device, dtype=torch.uint8, generator=g)
    s13 = torch.randint(119, 122, (E, 2 * F, D // 32), device=device, dtype=torch.uint8, generator=g)
    s2 = torch.randint(119, 122, (E, D, F // 32), device=device, dtype=torch.uint8, generator=g)
    b13 = torch.randn(E, 2 * F, device=device, generator=g).to(torch.bfloat16)
    b2 = (torch.randn(E, D, device=device, generator=g) * 0.1).to(torch.bfloat16)
    w13 = dequantize_mxfp4(q13, s13, torch.bfloat16)
    w2 = dequantize_mxfp4(q2, s2, torch.bfloat16)
    return {"q13": q13, "s13": s13, "q2": q2, "s2": s2, "w13": w13, "w2": w2, "b13": b13, "b2": b2}


def routings(M, E, K, n, device, seed):
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(n):
        tw, ti = torch.softmax(torch.randn(M, E, device=device, generator=g), -1).topk(K, dim=-1)
        out.append((tw, ti.to(torch.int32)))
    return out


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def floors_us(E, D, F, K, M, touched, w_bytes) -> tuple[float, float]:
    """(bytes floor, FLOP floor) in µs: the touched experts' weights and bf16 biases, bf16 x and out."""
    bytes_ = touched * (3 * D * F * w_bytes + (2 * F + D) * 2) + 2 * M * D * 2
    return bytes_ / HBM_BPS * 1e6, 2 * M * K * 3 * D * F / PEAK_FLOPS * 1e6


def cpu_time_ms(fns, M, reps):
    """Median ms of a call on the CPU (the smoke run's stand-in for time_calls)."""
    ts = []
    for i in range(max(len(fns), min(reps, 3))):
        t0 = time.perf_counter()
        fns[i % len(fns)]()
        ts.append(time.perf_counter() - t0)
    return 1e3 * sorted(ts)[len(ts) // 2]


def bench_shape(name, shape, Ms, args, rows, device):
    import torch
    from kernels.reference import fused_experts_torch
    from kernels.triton_moe import fused_experts_triton, fused_experts_triton_mxfp4
    from kernels.triton_moe.config import get_config
    E, D, F, K = shape
    smoke = device == "cpu"
    if smoke:
        time_ms = cpu_time_ms
    else:
        from kernels.triton_moe.tune import time_calls as time_ms
    t0 = time.time()
    w = make_weights(E, D, F, device)
    print(f"{name}: weights made in {time.time() - t0:.1f}s (MXFP4 "
          f"{(w['q13'].numel() + w['q2'].numel() + w['s13'].numel() + w['s2'].numel()) / 2 ** 30:.2f} GiB, "
          f"bf16 {(w['w13'].numel() + w['w2'].numel()) * 2 / 2 ** 30:.2f} GiB)", flush=True)
    kw = dict(w13_bias=w["b13"], w2_bias=w["b2"], activation="swigluoai")
    if smoke:  # the interpreter: a config of small blocks; on the GPU the shipped / default ones
        kw["config"] = SMOKE_CONFIG

    import kernels.triton_moe.fused as fused

    def mxfp4(x, tw, ti, scaled):
        """scaled: through tl.dot_scaled (MOE_MXFP4_DOT_SCALED), else the kernels' own dequantisation."""
        fused.MXFP4_DOT_SCALED = "1" if scaled else "0"
        return fused_experts_triton_mxfp4(x, w["q13"], w["q2"], w["s13"], w["s2"], tw, ti, **kw)

    def mxfp4_scaled(x, tw, ti):
        return mxfp4(x, tw, ti, scaled=True)

    def mxfp4_dequant(x, tw, ti):
        return mxfp4(x, tw, ti, scaled=False)

    def bf16(x, tw, ti):
        return fused_experts_triton(x, w["w13"], w["w2"], tw, ti, **kw)

    def swapped(base: dict, **tile):
        """--swap-ab: the kernels' own dequantisation with SWAP_AB in both GEMMs (gemm.py), on `base`
        (the shipped config) with `tile`'s keys changed, the down GEMM's too."""
        cfg = dict(base, SWAP_AB=True, **tile)
        if "down" in cfg:
            cfg["down"] = dict(cfg["down"], **{k: v for k, v in tile.items() if k != "BLOCK_SIZE_M"})

        def call(x, tw, ti):  # SWAP_AB tiles never go through tl.dot_scaled, whatever MXFP4_DOT_SCALED says
            return fused_experts_triton_mxfp4(x, w["q13"], w["q2"], w["s13"], w["s2"], tw, ti, **dict(kw, config=cfg))
        return call

    g = torch.Generator(device=device).manual_seed(1)
    for M in Ms:
        row = {"shape": name, "M": M, "E": E, "D": D, "F": F, "K": K}
        try:
            x = torch.randn(M, D, device=device, generator=g).to(torch.bfloat16)
            rts = routings(M, E, K, 2 if smoke else ROUTINGS if M <= 1024 else 1, device, seed=100 + M)
            row["experts_touched"] = touched = sum(len(torch.unique(ti)) for _, ti in rts) / len(rts)
            if not smoke:
                row["config_mxfp4"] = get_config(M, E, F, K, "mxfp4")
                row["config_bf16"] = get_config(M, E, F, K, torch.bfloat16)
            tw, ti = rts[0]
            out_mx, out_bf = mxfp4_dequant(x, tw, ti), bf16(x, tw, ti)
            row["rel_err_mxfp4_vs_bf16"] = rel_err(out_mx, out_bf)
            out_sc = mxfp4_scaled(x, tw, ti)
            row["rel_err_scaled_vs_dequant"] = rel_err(out_sc, out_mx)
            if M <= args.check_max_m:
                ref = fused_experts_torch(x, w["w13"], w["w2"], tw, ti, w13_bias=w["b13"], w2_bias=w["b2"],
                                          activation="swigluoai")
                row["rel_err_mxfp4"] = rel_err(out_mx, ref)
                row["rel_err_mxfp4_scaled"] = rel_err(out_sc, ref)
                row["rel_err_bf16"] = rel_err(out_bf, ref)
            forms = [("mxfp4", mxfp4_dequant, MXFP4_BYTES), ("mxfp4_scaled", mxfp4_scaled, MXFP4_BYTES),
                     ("bf16", bf16, 2)]
            if args.swap_ab:
                base = kw.get("config") or get_config(M, E, F, K, "mxfp4")
                forms += [("mxfp4_swap", swapped(base), MXFP4_BYTES),
                          ("mxfp4_swap_n128", swapped(base, BLOCK_SIZE_N=128, num_warps=8), MXFP4_BYTES)]
                if base["BLOCK_SIZE_M"] > 16:
                    forms.append(("mxfp4_swap_m16", swapped(base, BLOCK_SIZE_M=16), MXFP4_BYTES))
                for fmt, fn, _ in forms[3:]:
                    row[f"rel_err_{fmt}_vs_dequant"] = rel_err(fn(x, tw, ti), out_mx)
            for fmt, fn, wb in forms:
                us = 1e3 * time_ms([lambda tw=tw, ti=ti, fn=fn: fn(x, tw, ti) for tw, ti in rts], M,
                                   reps=args.reps)
                floor, flop_floor = floors_us(E, D, F, K, M, touched, wb)
                row[f"{fmt}_us"] = us
                row[f"{fmt}_bytes_floor_us"] = floor
                row[f"{fmt}_bytes_floor_over_time"] = floor / us
                row["flop_floor_us"] = flop_floor
            row["mxfp4_speedup"] = row["bf16_us"] / row["mxfp4_us"]
            row["scaled_speedup"] = row["mxfp4_us"] / row["mxfp4_scaled_us"]
            for fmt, _, _ in forms[3:]:
                row[f"{fmt}_speedup"] = row["mxfp4_us"] / row[f"{fmt}_us"]
        except Exception as e:  # report, do not stop the bench
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.partial_out:
            Path(args.partial_out).write_text(json.dumps({"rows": rows}, indent=1))
    w.clear()  # frees the weights before the next shape's
    if not smoke:
        torch.cuda.empty_cache()


def _fmt(v, f="{:.1f}"):
    return "–" if v is None else f.format(v)


def table(rows) -> str:
    lines = ["| shape | M | touched | MXFP4 µs | floor | floor/time | dot_scaled µs | floor/time | bf16 µs | floor | "
             "floor/time | speed-up | err MXFP4 | err vs bf16 |", "|" + "---|" * 14]
    for r in rows:
        lines.append("| " + " | ".join([
            r["shape"], str(r["M"]), _fmt(r.get("experts_touched"), "{:.1f}"),
            _fmt(r.get("mxfp4_us")), _fmt(r.get("mxfp4_bytes_floor_us")),
            _fmt(r.get("mxfp4_bytes_floor_over_time"), "{:.2f}"),
            _fmt(r.get("mxfp4_scaled_us")), _fmt(r.get("mxfp4_scaled_bytes_floor_over_time"), "{:.2f}"),
            _fmt(r.get("bf16_us")), _fmt(r.get("bf16_bytes_floor_us")),
            _fmt(r.get("bf16_bytes_floor_over_time"), "{:.2f}"), _fmt(r.get("mxfp4_speedup"), "{:.2f}"),
            _fmt(r.get("rel_err_mxfp4"), "{:.1e}"), _fmt(r.get("rel_err_mxfp4_vs_bf16"), "{:.1e}")]) + " |"
            + (f" error: {r['error']}" if "error" in r else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--M", type=int, nargs="+", default=None, help=f"tokens per call (default {MS})")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--check-max-m", type=int, default=1024,
                   help="largest M checked against the torch reference (MXFP4 vs bf16 is checked at every M)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--swap-ab", action="store_true",
                   help="also time SWAP_AB (the transposed product, gemm.py) on the shipped config, with BLOCK_SIZE_N "
                        "128 (8 warps), and with BLOCK_SIZE_M 16 where the shipped one is taller")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on the CPU under TRITON_INTERPRET=1 (no GPU): the script runs end to end")
    a = p.parse_args(argv)
    if a.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    import torch
    import triton
    if not a.cpu_smoke and not torch.cuda.is_available():
        print("bench_mxfp4_experts.py needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    device = "cpu" if a.cpu_smoke else "cuda"
    shapes = SMOKE_SHAPES if a.cpu_smoke else {n: SHAPES[n] for n in a.shapes}
    Ms = a.M or (SMOKE_MS if a.cpu_smoke else MS)
    t0 = time.time()
    result = {"device": "cpu (TRITON_INTERPRET=1)" if a.cpu_smoke else torch.cuda.get_device_name(),
              "date": time.strftime("%Y%m%d-%H%M%S"), "torch": torch.__version__, "triton": triton.__version__,
              "argv": sys.argv if argv is None else argv, "hbm_TBps": HBM_BPS / 1e12,
              "mxfp4_bytes_per_weight": MXFP4_BYTES, "routings_replayed": ROUTINGS}
    rows = result["rows"] = []
    a.partial_out = str(Path(a.out).with_suffix(".partial.json")) if a.out else None
    for name, shape in shapes.items():
        bench_shape(name, shape, Ms, a, rows, device)
    result["seconds"] = time.time() - t0
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        Path(a.partial_out).unlink(missing_ok=True)
        print(f"\nwrote {out}")
    print(f"{result['device']}, {result['seconds']:.0f}s")
    print(table(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
