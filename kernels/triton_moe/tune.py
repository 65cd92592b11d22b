"""Tuner for the expert GEMM launch configs (needs a CUDA GPU): `python -m kernels.triton_moe.tune` /
`moe tune-moe`.

For each token count M it tries a few BLOCK_M values (picked from the rows per expert), and for
each of them times the gate_up and the down GEMM separately over a short list of Hopper-sensible
(BLOCK_N, BLOCK_K, num_warps, num_stages) candidates, with the real alignment of softmax top-k
routing on random logits. The best BLOCK_M (sum of both GEMMs) wins; the down GEMM's own choice
goes under "down". A time budget keeps the search bounded; buckets it cannot reach get the
nearest tuned bucket's config. Writes config.config_file_name(...) into --out-dir.

Example:
    python -m kernels.triton_moe.tune --E 128 --D 2048 --F 768 --topk 8 --dtype bf16 \
        --M 1 8 64 256 1024 4096 16384 --out-dir kernels/configs
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kernels.triton_moe.config import (CONFIG_DIR, config_file_name, default_config, device_name,
                                      load_configs, nearest_bucket, split_config)
from kernels.triton_moe.fused import _run

# (BLOCK_N, BLOCK_K, num_warps, num_stages); gate_up holds two accumulators, so its BLOCK_N
# counts double in registers.
_SMALL = [(64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (32, 256, 4, 3),
          (64, 128, 4, 5), (128, 128, 8, 2), (64, 64, 4, 5), (128, 128, 4, 2), (64, 256, 4, 2)]
_MID = [(64, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 2), (128, 64, 8, 4),
        (128, 128, 4, 2), (64, 64, 4, 3), (256, 128, 4, 2)]
_LARGE = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 4), (64, 64, 4, 4), (256, 64, 8, 3),
          (256, 64, 8, 4), (128, 128, 8, 2)]
# --wide adds these at BLOCK_M 16 (decode): deeper pipelines, wider tiles, 8 warps
_SMALL_WIDE = [(64, 128, 4, 6), (32, 128, 4, 6), (32, 256, 4, 4), (128, 128, 8, 3),
               (256, 128, 8, 2), (128, 64, 4, 5), (64, 64, 4, 8), (128, 256, 8, 2),
               (64, 256, 8, 3), (32, 64, 2, 8), (64, 128, 8, 4), (16, 256, 4, 4)]
# and, for the down GEMM, (SPLIT_K, ATOMIC_SUM) variants of the first few tiles
_DOWN_SPLITS = [(1, True), (2, True), (4, True)]
# and for gate_up, SPLIT_K over D (partial sums, then a launch for the bias and the activation)
_UP_SPLITS = [2, 4, 8]
# --wide at BLOCK_M 64 and 128 (mixed and prefill steps): wider and deeper tiles, and HALF_TILES
# variants of the first few (an expert's last block of at most BLOCK_M / 2 rows runs a half-height tile)
_MID_WIDE = [(128, 64, 8, 3), (128, 128, 8, 3), (64, 128, 4, 4), (128, 64, 8, 5), (64, 64, 4, 5)]
_LARGE_WIDE = [(128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 8, 5), (128, 128, 8, 4)]
_HALF_TILE_VARIANTS = 4
# and on Hopper, the down GEMM's first few tiles with h and the weights through TMA descriptors
_TMA_VARIANTS = 4


def _block_ms(rows_per_expert: float, wide: bool = False) -> list[int]:
    if rows_per_expert <= 8:
        return [16]
    if rows_per_expert <= 32:
        return [16, 32]
    if rows_per_expert <= 96:
        return [32, 64] + ([128] if wide and rows_per_expert > 48 else [])  # 128: with half tiles
    if rows_per_expert <= 512:
        return [64, 128]
    return [128, 64]


def _candidates(bm: int, gate_up: bool, fp8: bool, wide: bool = False, mxfp4: bool = False, tma: bool = False):
    base = _SMALL if bm <= 16 else _MID if bm <= 64 else _LARGE
    if wide:
        base = base + (_SMALL_WIDE if bm <= 16 else _MID_WIDE if bm <= 64 else _LARGE_WIDE)
    out = []
    for bn, bk, w, s in base:
        if fp8:
            bk = 128
            if gate_up:
                bn = 128
        if gate_up and bm >= 128 and bn > 128:
            continue
        cfg = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk,
               "GROUP_SIZE_M": 1 if bm <= 16 else 8, "num_warps": w, "num_stages": s}
        if cfg not in out:
            out.append(cfg)
    tiles = list(out)
    if wide and bm >= 64:
        out += [dict(c, HALF_TILES=True) for c in tiles[:_HALF_TILE_VARIANTS]]
    if wide and tma and bm >= 64 and not gate_up and not (fp8 or mxfp4):
        out += [dict(c, TMA=True) for c in tiles[:_TMA_VARIANTS]]
    if wide and not gate_up:  # larger BLOCK_M: the atomic sum only, on the first two tiles
        splits, n = (_DOWN_SPLITS, 4) if bm <= 16 else (_DOWN_SPLITS[:1], 2)
        out += [dict(c, SPLIT_K=k, ATOMIC_SUM=a) for c in tiles[:n] for k, a in splits]
    if wide and gate_up and bm <= 16 and not fp8:  # decode: the D range split too (not FP8's)
        out += [dict(c, SPLIT_K=k) for c in tiles[:4] for k in _UP_SPLITS]
    if mxfp4 and bm <= 16:  # decode tiles: SWAP_AB first (the measured winner there, BENCHMARKS.md §1)
        out = [dict(c, SWAP_AB=True) for c in tiles[:4]] + out
    return out


def make_problem(E, D, F, K, M, dtype, with_weights=True, seed=0, device="cuda"):
    """Random weights (never zeros) and softmax top-k routing on random logits."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, D, device=device, dtype=dtype, generator=g)
    w13 = w2 = None
    if with_weights:
        w13 = torch.randn(E, 2 * F, D, device=device, dtype=dtype, generator=g) * D ** -0.5
        w2 = torch.randn(E, D, F, device=device, dtype=dtype, generator=g) * F ** -0.5
    logits = torch.randn(M, E, device=device, generator=g)
    tw, ti = torch.softmax(logits, -1).topk(K, dim=-1)
    return x, w13, w2, tw, ti.to(torch.int32)


def time_graph(fns, reps: int = 20) -> float:
    """Median ms of one call, from CUDA-graph replays of `fns` (one call each, on distinct
    inputs so that consecutive calls do not find their experts in L2)."""
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for f in fns:  # compile and warm up outside the capture
            f()
    cur.wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in ev)
    del g
    return ts[len(ts) // 2] / len(fns)


def time_events(fns, reps: int = 10) -> float:
    """Median ms of one call with CUDA events (for large calls, or ones that sync the host)."""
    for f in fns:
        f()
    ts = []
    for i in range(reps):
        f = fns[i % len(fns)]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def time_calls(fns, reps: int = 20) -> float:
    """Median ms of one call, by CUDA-graph replay at every size (time_graph). Eager CUDA events would time
    the host's launches too, which at mixed-step sizes outlast the kernels and vary by ±15% between
    identical configs (H100, 2048 tokens: 798 – 976 µs for ~605 µs of kernels). A call that cannot be
    captured raises RuntimeError; time_events is the caller's fallback."""
    return time_graph(fns, reps)


def kernel_times(fn, calls: int = 5) -> dict[str, float]:
    """Device µs a call of each kernel fn launches (torch.profiler over `calls` calls, after one
    more), by kernel name (its first 60 characters), largest first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if us:
            totals[ev.key[:60]] = totals.get(ev.key[:60], 0.0) + us / calls
    return {k: round(v, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def compose(cfg_up: dict, cfg_down: dict) -> dict:
    """The config file entry of a gate_up and a down launch config (split_config's inverse): the
    down GEMM's keys under "down", HALF_TILES and SWAP_AB there too (false) where only gate_up has them."""
    cfg = dict(cfg_up)
    cfg["down"] = {k: v for k, v in cfg_down.items() if k != "BLOCK_SIZE_M"}
    for key in ("HALF_TILES", "SWAP_AB"):
        if cfg_up.get(key) and not cfg_down.get(key):
            cfg["down"][key] = False
    return cfg


def _time_split(cfg_up, cfg_down, problems, quant_w):
    """quant_w: None (16-bit weights in the problems) or (kind, (q13, q2), (s13, s2)), kind "fp8"
    or "mxfp4"."""
    cfg = compose(cfg_up, cfg_down)

    def mk(x, w13, w2, tw, ti):
        if quant_w is not None:
            kind, (q13, q2), scales = quant_w
            return lambda: _run(x, q13, q2, tw, ti, None, cfg, **{kind: scales})
        return lambda: _run(x, w13, w2, tw, ti, None, cfg)
    return time_calls([mk(*p) for p in problems], reps=14)


def tune_one(E, D, F, K, M, dtype, budget_s, quant_w=None, prior=None, wide=False, default=None):
    """(best config, its ms, {"default": ms, "prior": ms} of those given) for T=M; `prior` (the
    config in use, e.g. the shipped one) is tried first; `default` (the untuned fallback) and `prior`
    are timed again on the same problems at the end, so the report compares the winner with both, and
    either is kept when nothing searched beats it."""
    fp8 = quant_w is not None and quant_w[0] == "fp8"
    mxfp4 = quant_w is not None and quant_w[0] == "mxfp4"
    x, w13, w2, tw, ti = make_problem(E, D, F, K, M, dtype, with_weights=quant_w is None)
    # a few routings, so that consecutive timed calls touch different experts
    n_prob = 4 if M <= 256 else 1
    problems = [(x, w13, w2, tw, ti)]
    for s in range(1, n_prob):
        logits = torch.randn(M, E, device=x.device)
        tw_s, ti_s = torch.softmax(logits, -1).topk(K, dim=-1)
        problems.append((x, w13, w2, tw_s, ti_s.to(torch.int32)))
    t_start, best = time.monotonic(), None
    tma = quant_w is None and torch.cuda.get_device_capability()[0] >= 9  # TMA descriptors: Hopper on
    bms = _block_ms(M * K / E, wide)
    if prior is not None and prior["BLOCK_SIZE_M"] not in bms:
        bms = [prior["BLOCK_SIZE_M"]] + bms
    for i, bm in enumerate(bms):  # each BLOCK_M its share of what is left, at least one candidate each
        t_end = time.monotonic() + (budget_s - (time.monotonic() - t_start)) / (len(bms) - i)
        ups, downs = _candidates(bm, True, fp8, wide, mxfp4), _candidates(bm, False, fp8, wide, mxfp4, tma)
        if prior is not None and prior["BLOCK_SIZE_M"] == bm:
            p_up, p_down = split_config(prior)
            p_ups, p_downs = [p_up], [p_down]
            if wide and bm >= 64:  # the shipped tile with half tiles next
                p_ups.append(dict(p_up, HALF_TILES=not p_up.get("HALF_TILES")))
                p_downs.append({k: v for k, v in p_down.items() if k != "TMA"}
                               | {"HALF_TILES": not p_down.get("HALF_TILES")})
                if tma and not p_down.get("TMA"):  # and through TMA (which has no half tiles)
                    p_downs.append(dict(p_down, HALF_TILES=False, TMA=True))
            ups = p_ups + [c for c in ups if c not in p_ups]
            downs = p_downs + [c for c in downs if c not in p_downs]
        # coordinate search: gate_up candidates with the first down, then downs with the best up
        up_best, t_up = ups[0], float("inf")
        for c in ups:
            if time.monotonic() > t_end and t_up < float("inf"):
                break
            try:
                t = _time_split(c, downs[0], problems, quant_w)
            except Exception as e:  # out of resources etc.
                print(f"  skip {c}: {type(e).__name__}")
                continue
            if t < t_up:
                up_best, t_up = c, t
        down_best, t_tot = downs[0], t_up
        for c in downs[1:]:
            if time.monotonic() > t_end:
                break
            try:
                t = _time_split(up_best, c, problems, quant_w)
            except Exception as e:
                print(f"  skip {c}: {type(e).__name__}")
                continue
            if t < t_tot:
                down_best, t_tot = c, t
        cfg = compose(up_best, down_best)
        if best is None or t_tot < best[1]:
            best = (cfg, t_tot)
    baselines = {}
    for which, cfg in (("default", default), ("prior", prior)):  # a short search can miss either's tile
        if cfg is not None:
            baselines[which] = _time_split(*split_config(cfg), problems, quant_w)
            if baselines[which] < best[1]:
                best = (dict(cfg), baselines[which])
    shown = "".join(f" ({which} config {t * 1e3:.1f} us)" for which, t in baselines.items())
    print(f"M={M}: {best[1] * 1e3:.1f} us{shown}  {best[0]}", flush=True)
    return best[0], best[1], baselines


def tune(E, D, F, K, Ms, dtype_name="bf16", budget_s=120.0, out_dir=CONFIG_DIR,
         block_shape=None, wide=False, report=None):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
             "fp8_w8a8": torch.bfloat16, "mxfp4": torch.bfloat16}[dtype_name]
    quant_w = None
    if dtype_name == "fp8_w8a8":
        block_shape = tuple(block_shape or (128, 128))
        from kernels.reference_fp8 import quantize_block_fp8
        _, w13, w2, _, _ = make_problem(E, D, F, K, 1, torch.bfloat16)
        q13 = [quantize_block_fp8(w, block_shape) for w in w13]
        q2 = [quantize_block_fp8(w, block_shape) for w in w2]
        del w13, w2
        quant_w = ("fp8", (torch.stack([q for q, _ in q13]), torch.stack([q for q, _ in q2])),
                   (torch.stack([s for _, s in q13]), torch.stack([s for _, s in q2])))
    elif dtype_name == "mxfp4":  # random codes; scales 2^-8 .. 2^-6 give weights of the size of D^-0.5
        g = torch.Generator(device="cuda").manual_seed(0)
        codes = [torch.randint(0, 256, shape, device="cuda", dtype=torch.uint8, generator=g)
                 for shape in ((E, 2 * F, D // 2), (E, D, F // 2))]
        scales = [torch.randint(119, 122, shape, device="cuda", dtype=torch.uint8, generator=g)
                  for shape in ((E, 2 * F, D // 32), (E, D, F // 32))]
        quant_w = ("mxfp4", tuple(codes), tuple(scales))
    results, rows = {}, []
    name = config_file_name(E, F, device_name(), dtype_name, block_shape)
    priors = load_configs(name)
    t0 = time.monotonic()
    for i, M in enumerate(Ms):
        left = budget_s - (time.monotonic() - t0)
        share = left / (len(Ms) - i)
        if share <= 0 and results:
            break
        prior = nearest_bucket(priors, M) if priors else None
        default = default_config(M, E, F, K, dtype_name, block_shape)
        cfg, t, baselines = tune_one(E, D, F, K, M, dtype, max(share, 1.0), quant_w, prior, wide, default)
        results[M] = cfg
        row = {"M": M, "tuned_us": t * 1e3, "config": cfg}
        for which, t_base in baselines.items():  # speedup: over the default; speedup_over_prior: the file in use
            row[f"{which}_us"] = t_base * 1e3
            row["speedup" if which == "default" else f"speedup_over_{which}"] = t_base / t
        rows.append(row)
        torch.cuda.empty_cache()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    merged = dict(priors or {})  # buckets not tuned now keep their current config
    merged.update(results)
    with open(out / name, "w") as f:
        json.dump({str(m): c for m, c in sorted(merged.items())}, f, indent=2)
    print(f"wrote {out / name}")
    if report:
        with open(report, "w") as f:
            json.dump({"E": E, "D": D, "F": F, "topk": K, "dtype": dtype_name, "device": device_name(),
                       "times": "one call, gate_up + down, CUDA-graph replay",
                       "rows": rows}, f, indent=1)
    return out / name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moe tune-moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--E", type=int, required=True, help="local experts")
    p.add_argument("--D", type=int, required=True, help="hidden size")
    p.add_argument("--F", type=int, required=True, help="expert intermediate size (N)")
    p.add_argument("--topk", type=int, required=True)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8_w8a8", "mxfp4"],
                   help="the weights' form (mxfp4: gpt-oss's E2M1 codes and E8M0 scales, bf16 activations)")
    p.add_argument("--block-shape", type=int, nargs=2, default=None,
                   help="FP8 weight block (bn bk); default 128 128 for fp8_w8a8")
    p.add_argument("--M", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096, 16384])
    p.add_argument("--budget-s", type=float, default=120.0, help="time budget of the search")
    p.add_argument("--out-dir", default=str(CONFIG_DIR),
                   help="where to write the file; buckets not in --M keep the configs of the "
                        "file in use now (MOE_KERNEL_CONFIG_DIR or the shipped one)")
    p.add_argument("--wide", action="store_true",
                   help="search more tiles (decode: BLOCK_M 16; mixed and prefill steps: BLOCK_M 64 / 128 with "
                        "half tiles, and BLOCK_M 128 from 48 rows an expert), split-K / atomic-sum downs and, at "
                        "decode, split-K gate_ups")
    p.add_argument("--report", default=None,
                   help="write a JSON of the tuned and the default (untuned) config's time per M here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("tuning needs a CUDA GPU")
    tune(a.E, a.D, a.F, a.topk, a.M, a.dtype, a.budget_s, a.out_dir, a.block_shape, a.wide, a.report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
