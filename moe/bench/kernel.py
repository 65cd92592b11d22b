"""Expert-layer benchmark (`moe bench kernel`; needs a CUDA GPU).

Shapes: qwen3-30b-a3b, deepseek-v3, llama4-scout; M in 1..16384. Contenders: the Triton kernel
(alignment included), vLLM's fused_moe_kernel with vLLM's H200 configs in the same run (when
benchmarks/fetch_vllm_kernel.py has fetched it, see moe/bench/vllm_kernel.py), the torch
reference (per-expert loop), torch._grouped_mm with its torch sort/gather/scatter, and FP8
block-quantised rows for deepseek-v3. CUDA-graph replay at every M (CUDA events for a contender that
cannot be captured, labelled so); medians. Each row also checks correctness on fresh random inputs
(‖out − ref‖/‖ref‖ in fp32) and reports floor/time, the floor being the larger of
(bytes of the experts touched + activations) / 4.8 TB/s and FLOPs / 700 TFLOP/s.

    moe bench kernel [--shapes qwen3-30b-a3b ...] [--M 1 8 ...]
        [--out benchmarks/results/kernel_<date>.json]
        [--rows qwen3-30b-a3b:8,64 llama4-scout:1]   (shape:M list pairs, in this order)
        [--profile] [--no-baselines] [--no-deepspeed]

--profile adds each row's per-kernel device time (torch.profiler over eager calls), to see
where the Triton call's time goes (alignment, gate_up, down, sum/cast) and how much of the
graph-replay time lies between kernels. The deepspeed backend (CUTLASS MoE GEMM of the
deepspeed-kernels package, kernels/deepspeed_moe.py) is a contender where its library loads;
its transposed weight copies are made before timing. vLLM's row is a tie with ours when the
two times differ by less than --tie-band (default 5%, the run-to-run spread of these timings).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path

import torch

from moe.bench.vllm_kernel import load_vllm_experts

SHAPES = {  # name: (E, D, F, top-k)
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseek-v3": (256, 7168, 2048, 8),
    "llama4-scout": (16, 5120, 8192, 1),
}
MS = [1, 8, 64, 256, 1024, 4096, 16384]
HBM_BPS, PEAK_FLOPS = 4.8e12, 700e12
N_ROUTINGS = 4  # distinct routings replayed in turn, so experts are not found warm in L2


def ceilings() -> dict:
    from kernels.triton_moe.tune import time_events
    a = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t_copy = time_events([lambda: b.copy_(a)], reps=10)
    a = b = None  # free 4 GiB before the matmul
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_mm = time_events([lambda: x @ y], reps=10)
    return {"d2d_copy_TBps": 2 * 2 * 1024 ** 3 / t_copy / 1e9,
            "bf16_matmul_8192_TFLOPs": 2 * 8192 ** 3 / t_mm / 1e9}


def grouped_mm_experts(x, w13, w2, tw, ti):
    """torch._grouped_mm with the torch sort / gather / scatter around it (no host sync)."""
    T, D = x.shape
    E = w13.shape[0]
    K = ti.shape[1]
    flat = ti.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    xs = x[order // K]
    gu = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
    F = gu.shape[1] // 2
    h = torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]
    o = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs).float()
    o = o * tw.reshape(-1)[order].float()[:, None]
    out = torch.zeros(T, D, device=x.device, dtype=torch.float32)
    out.index_add_(0, order // K, o)
    return out.to(x.dtype)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def floor_us(E, D, F, K, M, touched, act_bytes=2, w_bytes=2) -> float:
    bytes_ = touched * 3 * D * F * w_bytes + 2 * M * D * act_bytes
    flops = 2 * M * K * 3 * D * F
    return max(bytes_ / HBM_BPS, flops / PEAK_FLOPS) * 1e6


def _routings(M, E, K, n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(n):
        logits = torch.randn(M, E, device="cuda", generator=g)
        tw, ti = torch.softmax(logits, -1).topk(K, dim=-1)
        out.append((tw, ti.to(torch.int32)))
    return out


def kernel_breakdown(fns, calls: int = 8) -> dict:
    """Device µs per call of each kernel name, from torch.profiler over eager calls."""
    from torch.profiler import ProfilerActivity, profile
    for f in fns:
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fns[i % len(fns)]()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            out[ev.key[:60]] = round(t / calls, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def host_time_us(fn, reps: int) -> float:
    """Median µs until `fn` returns on the host (its launches), the GPU drained between calls."""
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * sorted(ts)[len(ts) // 2]


def time_alignment_paths(rts, E, F, K, M, reps) -> dict:
    """µs of align_tokens alone on each path it can take here (the shipped BLOCK_M)."""
    from kernels.triton_moe.align import align_tokens
    from kernels.triton_moe.config import get_config
    from kernels.triton_moe.tune import time_calls
    bm = get_config(M, E, F, K, torch.bfloat16)["BLOCK_SIZE_M"]
    out = {}
    for path in ("ranked", "small", "large"):
        out[f"align_{path}_us"] = 1e3 * time_calls(
            [lambda ti=ti: align_tokens(ti, E, bm, path=path) for _, ti in rts], reps=reps)
    return out


def deepspeed_backend(args):
    """fused_experts_deepspeed if its library loads here (and not --no-deepspeed), else None."""
    if args.no_deepspeed:
        return None
    try:
        from kernels import deepspeed_moe
        return deepspeed_moe.fused_experts_deepspeed if deepspeed_moe.available("cuda") else None
    except Exception as e:  # report, do not stop the bench
        print(f"deepspeed backend unavailable: {type(e).__name__}: {e}", flush=True)
        return None


def bench_shape(name, Ms, args, rows):
    from kernels.reference import fused_experts_torch
    from kernels.reference_fp8 import fused_experts_fp8_torch
    from kernels.triton_moe import fused_experts_triton, fused_experts_triton_fp8
    from kernels.triton_moe.tune import time_calls, time_events
    E, D, F, K = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(1)
    w13 = torch.randn(E, 2 * F, D, device="cuda", dtype=torch.bfloat16, generator=g) * D ** -0.5
    w2 = torch.randn(E, D, F, device="cuda", dtype=torch.bfloat16, generator=g) * F ** -0.5
    ds = deepspeed_backend(args)
    fp8 = None
    if name in args.fp8_shapes:
        from kernels.reference_fp8 import quantize_block_fp8
        q = [quantize_block_fp8(w13[e]) + quantize_block_fp8(w2[e]) for e in range(E)]
        fp8 = tuple(torch.stack([t[i] for t in q]) for i in range(4))  # q13, s13, q2, s2
        del q
    for mi, M in enumerate(Ms):
        row = {"shape": name, "M": M, "E": E, "D": D, "F": F, "K": K}
        try:
            x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, generator=g)
            rts = _routings(M, E, K, N_ROUTINGS if M <= 1024 else 1, seed=100 + M)
            row["experts_touched"] = sum(len(torch.unique(ti)) for _, ti in rts) / len(rts)
            row["floor_us"] = floor_us(E, D, F, K, M, row["experts_touched"])
            # correctness on fresh inputs (smaller M for the slow reference at the largest M)
            Mc = min(M, 4096)
            xc = torch.randn(Mc, D, device="cuda", dtype=torch.bfloat16, generator=g)
            (twc, tic), = _routings(Mc, E, K, 1, seed=7 + M)
            ref = fused_experts_torch(xc, w13, w2, twc, tic)
            row["rel_err_triton"] = rel_err(fused_experts_triton(xc, w13, w2, twc, tic), ref)
            row["triton_us"] = 1e3 * time_calls(
                [lambda tw=tw, ti=ti: fused_experts_triton(x, w13, w2, tw, ti) for tw, ti in rts],
                reps=args.reps)
            if args.profile:
                row["triton_kernels_us"] = kernel_breakdown(
                    [lambda tw=tw, ti=ti: fused_experts_triton(x, w13, w2, tw, ti)
                     for tw, ti in rts])
                row.update(time_alignment_paths(rts, E, F, K, M, args.reps))
                row["triton_host_us"] = host_time_us(
                    lambda: fused_experts_triton(x, w13, w2, *rts[0]), args.reps)
            if args.vllm is not None:
                try:
                    row["rel_err_vllm"] = rel_err(args.vllm(xc, w13, w2, twc, tic), ref)
                    row["vllm_config"] = args.vllm.config(M, E, F, K)[1]
                    row["vllm_us"] = 1e3 * time_calls(
                        [lambda tw=tw, ti=ti: args.vllm(x, w13, w2, tw, ti) for tw, ti in rts], reps=args.reps)
                except Exception as e:  # report, do not stop the bench
                    row["vllm_error"] = f"{type(e).__name__}: {e}"[:300]
            if ds is not None:
                try:
                    row["rel_err_deepspeed"] = rel_err(ds(xc, w13, w2, twc, tic), ref)
                    dfns = [lambda tw=tw, ti=ti: ds(x, w13, w2, tw, ti) for tw, ti in rts]
                    try:
                        row["deepspeed_us"] = 1e3 * time_calls(dfns, reps=args.reps)
                    except RuntimeError:  # not capturable: time it with events
                        torch.cuda.synchronize()
                        row["deepspeed_us"] = 1e3 * time_events(dfns, reps=args.reps)
                        row["deepspeed_timing"] = "events (graph capture failed)"
                except Exception as e:
                    row["deepspeed_error"] = f"{type(e).__name__}: {e}"[:300]
            if hasattr(torch, "_grouped_mm") and not args.no_baselines:
                try:
                    row["rel_err_grouped_mm"] = rel_err(grouped_mm_experts(xc, w13, w2, twc, tic),
                                                        ref)
                    gfns = [lambda tw=tw, ti=ti: grouped_mm_experts(x, w13, w2, tw, ti)
                            for tw, ti in rts]
                    try:
                        row["grouped_mm_us"] = 1e3 * time_calls(gfns, reps=args.reps)
                    except RuntimeError:  # its internals copy from the host: not capturable
                        torch.cuda.synchronize()
                        row["grouped_mm_us"] = 1e3 * time_events(gfns, reps=args.reps)
                        row["grouped_mm_timing"] = "events (graph capture failed)"
                except Exception as e:  # unsupported on this build / device
                    row["grouped_mm_error"] = f"{type(e).__name__}: {e}"[:200]
            if M <= args.torch_max_m and not args.no_baselines:
                tw, ti = rts[0]
                row["torch_us"] = 1e3 * time_events(
                    [lambda: fused_experts_torch(x, w13, w2, tw, ti)], reps=3)
            del ref
            if fp8 is not None:
                q13, s13, q2, s2 = fp8
                ref8 = fused_experts_fp8_torch(xc, q13, q2, s13, s2, twc, tic) if Mc <= 1024 \
                    else None
                out8 = fused_experts_triton_fp8(xc, q13, q2, s13, s2, twc, tic)
                if ref8 is not None:
                    row["rel_err_fp8_vs_dequant_ref"] = rel_err(out8, ref8)
                row["rel_err_fp8_vs_bf16_ref"] = rel_err(
                    out8, fused_experts_torch(xc, w13, w2, twc, tic))
                row["fp8_us"] = 1e3 * time_calls(
                    [lambda tw=tw, ti=ti: fused_experts_triton_fp8(x, q13, q2, s13, s2, tw, ti)
                     for tw, ti in rts], reps=args.reps)
                row["fp8_floor_us"] = floor_us(E, D, F, K, M, row["experts_touched"], w_bytes=1)
                del ref8, out8
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        if "triton_us" in row:
            row["floor_over_time"] = row["floor_us"] / row["triton_us"]
            if "vllm_us" in row:
                row["vllm_over_triton"] = ratio = row["vllm_us"] / row["triton_us"]
                row["vllm_vs_triton"] = "tie" if abs(ratio - 1) < args.tie_band else \
                    "triton faster" if ratio > 1 else "vllm faster"
            if "fp8_us" in row:
                row["fp8_floor_over_time"] = row["fp8_floor_us"] / row["fp8_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.partial_out:
            Path(args.partial_out).write_text(json.dumps({"rows": rows}, indent=1))
        torch.cuda.empty_cache()
    w13 = w2 = fp8 = None
    torch.cuda.empty_cache()


def _fmt(v, f="{:.0f}"):
    return "–" if v is None else f.format(v)


def table(rows) -> str:
    hdr = ("| shape | M | touched | floor µs | torch µs | _grouped_mm µs | deepspeed µs | "
           "triton µs | floor/time | vLLM µs | vLLM/triton | rel err | fp8 µs | fp8 err |")
    lines = [hdr, "|" + "---|" * 14]
    for r in rows:
        lines.append("| " + " | ".join([
            r["shape"], str(r["M"]), _fmt(r.get("experts_touched"), "{:.0f}"),
            _fmt(r.get("floor_us")), _fmt(r.get("torch_us")), _fmt(r.get("grouped_mm_us")),
            _fmt(r.get("deepspeed_us")),
            _fmt(r.get("triton_us"), "{:.1f}"), _fmt(r.get("floor_over_time"), "{:.2f}"),
            _fmt(r.get("vllm_us")), _fmt(r.get("vllm_over_triton"), "{:.2f}"),
            _fmt(r.get("rel_err_triton"), "{:.1e}"), _fmt(r.get("fp8_us"), "{:.1f}"),
            _fmt(r.get("rel_err_fp8_vs_dequant_ref"), "{:.1e}")]) + " |"
            + (f" error: {r['error']}" if "error" in r else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moe bench kernel", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--M", type=int, nargs="+", default=MS)
    p.add_argument("--fp8-shapes", nargs="*", default=["deepseek-v3"])
    p.add_argument("--torch-max-m", type=int, default=4096,
                   help="largest M for the (slow) torch reference timing")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-ceilings", action="store_true")
    p.add_argument("--rows", nargs="+", default=None,
                   help="shape:M[,M...] pairs, run in this order (overrides --shapes/--M)")
    p.add_argument("--profile", action="store_true",
                   help="add each row's per-kernel device times (torch.profiler)")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the torch loop and torch._grouped_mm timings")
    p.add_argument("--no-deepspeed", action="store_true", help="skip the deepspeed backend")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's kernel even when it was fetched")
    p.add_argument("--tie-band", type=float, default=0.05,
                   help="vLLM and ours tie when their times differ by less than this fraction")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    p.add_argument("--out", default=f"benchmarks/results/kernel_{stamp}.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe bench kernel needs a CUDA GPU (none is visible here)", file=sys.stderr)
        return 2
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name(), "date": stamp,
              "torch": torch.__version__, "argv": sys.argv if argv is None else argv}
    import triton
    result["triton"] = triton.__version__
    a.vllm = None if a.no_vllm else load_vllm_experts()
    result["vllm"] = a.vllm.version if a.vllm is not None else \
        "not fetched (python benchmarks/fetch_vllm_kernel.py)" if not a.no_vllm else "skipped"
    print(f"vLLM kernel: {result['vllm']}", flush=True)
    if not a.no_ceilings:
        result["ceilings"] = ceilings()
        print(json.dumps(result["ceilings"]), flush=True)
    rows = result["rows"] = []
    a.partial_out = str(Path(a.out).with_suffix(".partial.json"))
    plan = [(n, a.M) for n in a.shapes]
    if a.rows:
        plan = [(r.split(":")[0], [int(m) for m in r.split(":")[1].split(",")]) for r in a.rows]
        for n, _ in plan:
            if n not in SHAPES:
                p.error(f"unknown shape {n}")
    for name, Ms in plan:
        bench_shape(name, Ms, a, rows)
    result["seconds"] = time.time() - t0
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}; {result['device']}; {result.get('ceilings')}")
    print(table(rows))
    for r in rows:
        if "triton_kernels_us" in r:
            print(f"{r['shape']} M={r['M']}: triton {r['triton_us']:.1f} us (graph); kernels: "
                  + ", ".join(f"{k} {v}" for k, v in r["triton_kernels_us"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
