"""Qwen3-Next's Gated DeltaNet kernels on one GPU: the Triton recurrent delta rule and causal conv
(kernels/triton_gated_delta.py), the Triton chunked delta rule (kernels/triton_gated_delta_chunked.py,
over a grid of chunk sizes, value blocks and dot precisions) against the torch reference
(kernels/gated_delta.py, chunked for prefill) and, when installed, flash-linear-attention's chunked
kernel (fla-core's chunk_gated_delta_rule, the field's library), same inputs, same run.

Shapes: one layer at TP=1 (16 key heads, 32 value heads, head dims 128; conv over 8192 channels, 4 taps),
bf16 activations, fp32 states in a pool of 512 slots. Decode: B sequences of one token (the state read
and written: 2 x 2 MB a sequence; floor = those bytes at 4.8 TB/s). Prefill: sequences of n new tokens
over a carried state (floor: the FLOPs of the chunked form at 700 TFLOP/s, or its bytes). Times are
medians of triton.testing.do_bench (CUDA events), decode also replayed from a CUDA graph; errors
||out - ref|| / ||ref|| against the torch reference.

    python benchmarks/bench_gated_delta.py [--out benchmarks/results/gated_delta_h200.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root

HK, HV, DK, DV, K_TAPS, SLOTS = 16, 32, 128, 128, 4, 512
HBM_BPS, PEAK_FLOPS = 4.8e12, 700e12
DECODES = [1, 64, 256]
PREFILLS = [(1, 4096), (8, 512), (4, 64)]  # (sequences, new tokens each)
# the chunked kernel's grid: (chunk, block_v, num_warps, precision); the best one also runs at ieee
CHUNKED = [(c, bv, w, p) for p in ("tf32x3", "tf32")
           for c, bv, w in ((16, 32, 4), (16, 64, 4), (32, 64, 8), (32, 128, 8), (64, 64, 8))]


def inputs(torch, B, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = B * n

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)
    q, k, v = rnd(T, HK, DK), rnd(T, HK, DK), rnd(T, HV, DV)
    decay = -torch.rand(T, HV, device="cuda", generator=g) * 0.5
    beta = torch.rand(T, HV, device="cuda", generator=g).to(torch.bfloat16)
    pool = torch.randn(SLOTS, HV, DK, DV, device="cuda", generator=g) * 0.1
    slots = torch.randperm(SLOTS, device="cuda", generator=g)[:B]
    qsl = list(range(0, T + 1, n))
    return q, k, v, decay, beta, pool, slots, qsl


def mixed_step(torch, do_bench, reference, recurrent, chunked, num_decodes=255, chunk=512) -> dict:
    """A mixed step's layer: num_decodes one-token sequences beside a chunk-token prefill, through
    the recurrent kernel alone and through the chunked one (its decodes still token by token)."""
    decodes = inputs(torch, num_decodes + 1, 1, seed=7)  # its pool and num_decodes + 1 slots
    prefill = inputs(torch, 1, chunk, seed=8)
    q, k, v, decay, beta = (torch.cat([a[:num_decodes], b]) for a, b in zip(decodes[:5], prefill[:5]))
    pool, slots = decodes[5], decodes[6]
    T = num_decodes + chunk
    qsl = list(range(num_decodes + 1)) + [T]
    init = torch.ones(num_decodes + 1, dtype=torch.bool, device="cuda")
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device="cuda")
    ref_pool = pool.clone()
    ref = reference(q, k, v, decay, beta, qsl, ref_pool, slots, init)
    row = {"kind": "mixed", "decodes": num_decodes, "chunk_tokens": chunk}
    for name, fn in (("recurrent", recurrent), ("chunked", chunked)):
        work = pool.clone()
        out = fn(q, k, v, decay, beta, qsl_t, work, slots, init)
        row[f"{name}_us"] = do_bench(lambda: fn(q, k, v, decay, beta, qsl_t, work, slots, init), warmup=5, rep=30,
                                     return_mode="median") * 1e3
        row[f"{name}_rel_err"] = rel(out, ref)
    return row


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch
    from triton.testing import do_bench

    from kernels.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen
    from kernels.triton_gated_delta import causal_conv1d_varlen_triton, gated_delta_rule_recurrent_triton
    from kernels.triton_gated_delta_chunked import gated_delta_rule_chunked_triton

    if not torch.cuda.is_available():
        raise SystemExit("bench_gated_delta.py needs a GPU")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        chunk_gated_delta_rule = None
    rows = []
    state_bytes = HV * DK * DV * 4
    for B in DECODES:
        q, k, v, decay, beta, pool, slots, qsl = inputs(torch, B, 1, seed=B)
        init = torch.ones(B, dtype=torch.bool, device="cuda")
        qsl_t = torch.tensor(qsl, dtype=torch.int32, device="cuda")
        ref_pool = pool.clone()
        ref = gated_delta_rule_varlen(q, k, v, decay, beta, qsl, ref_pool, slots, init)
        work = pool.clone()
        out = gated_delta_rule_recurrent_triton(q, k, v, decay, beta, qsl_t, work, slots, init)
        err, state_err = rel(out, ref), rel(work[slots], ref_pool[slots])

        def step():
            return gated_delta_rule_recurrent_triton(q, k, v, decay, beta, qsl_t, work, slots, init)
        t_eager = do_bench(step, warmup=20, rep=100, return_mode="median") * 1e3
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        t_graph = do_bench(graph.replay, warmup=20, rep=100, return_mode="median") * 1e3
        t_torch = do_bench(lambda: gated_delta_rule_varlen(q, k, v, decay, beta, qsl, pool.clone(), slots, init),
                           warmup=5, rep=20, return_mode="median") * 1e3
        floor = 2 * B * state_bytes / HBM_BPS * 1e6
        x = torch.randn(B, 2 * HK * DK + HV * DV, device="cuda").to(torch.bfloat16)
        w = torch.randn(x.shape[1], K_TAPS, device="cuda").to(torch.bfloat16)
        conv_pool = torch.randn(SLOTS, x.shape[1], K_TAPS - 1, device="cuda").to(torch.bfloat16)
        conv_ref = causal_conv1d_varlen(x, w, None, qsl, conv_pool.clone(), slots, init)
        conv_out = causal_conv1d_varlen_triton(x, w, None, qsl_t, conv_pool, slots, init)
        t_conv = do_bench(lambda: causal_conv1d_varlen_triton(x, w, None, qsl_t, conv_pool, slots, init),
                          warmup=20, rep=100, return_mode="median") * 1e3
        # the chunked entry point on a decode-only batch (the recurrent kernel plus its own launches; the
        # engine sends decode-only steps to the recurrent kernel alone)
        chunked_work = pool.clone()
        chunked_out = gated_delta_rule_chunked_triton(q, k, v, decay, beta, qsl_t, chunked_work, slots, init)
        t_chunked = do_bench(lambda: gated_delta_rule_chunked_triton(q, k, v, decay, beta, qsl_t, chunked_work,
                                                                     slots, init), warmup=20, rep=100,
                             return_mode="median") * 1e3
        rows.append({"kind": "decode", "B": B, "triton_us": t_eager, "triton_graph_us": t_graph, "torch_us": t_torch,
                     "floor_us": floor, "floor_over_graph": floor / t_graph, "rel_err": err, "state_rel_err": state_err,
                     "chunked_us": t_chunked, "chunked_rel_err": rel(chunked_out, ref),
                     "conv_triton_us": t_conv, "conv_rel_err": rel(conv_out, conv_ref)})
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    for B, n in PREFILLS:
        q, k, v, decay, beta, pool, slots, qsl = inputs(torch, B, n, seed=B * n)
        pool0 = pool.clone()  # fla's calls below advance pool's states (the engine's scatter back)
        init = torch.ones(B, dtype=torch.bool, device="cuda")
        qsl_t = torch.tensor(qsl, dtype=torch.int32, device="cuda")
        ref_pool = pool.clone()
        ref = gated_delta_rule_varlen(q, k, v, decay, beta, qsl, ref_pool, slots, init)
        work = pool.clone()
        out = gated_delta_rule_recurrent_triton(q, k, v, decay, beta, qsl_t, work, slots, init)
        t_triton = do_bench(lambda: gated_delta_rule_recurrent_triton(q, k, v, decay, beta, qsl_t, work, slots, init),
                            warmup=5, rep=30, return_mode="median") * 1e3
        t_torch = do_bench(lambda: gated_delta_rule_varlen(q, k, v, decay, beta, qsl, pool.clone(), slots, init),
                           warmup=3, rep=10, return_mode="median") * 1e3
        T = B * n
        # chunked form: per token and value head ~ (4 Dk Dv + 2 x 64 (Dk + Dv)) multiply-adds
        flops = 2 * T * HV * (4 * DK * DV + 128 * (DK + DV))
        moved = 2 * B * state_bytes + T * (2 * HK * DK + 2 * HV * DV) * 2
        row = {"kind": "prefill", "B": B, "new_tokens": n, "triton_us": t_triton, "torch_us": t_torch,
               "floor_us": max(flops / PEAK_FLOPS, moved / HBM_BPS) * 1e6, "rel_err": rel(out, ref),
               "state_rel_err": rel(work[slots], ref_pool[slots])}
        if chunk_gated_delta_rule is not None:
            cu = torch.tensor(qsl, dtype=torch.long, device="cuda")

            def fla():
                o, h = chunk_gated_delta_rule(q[None], k[None], v[None], decay[None], beta[None],
                                              initial_state=pool[slots], output_final_state=True, cu_seqlens=cu,
                                              use_qk_l2norm_in_kernel=True)
                pool[slots] = h.float()  # the engine's scatter back into the slots
                return o[0]
            fla_out = fla()
            row["fla_us"] = do_bench(fla, warmup=5, rep=30, return_mode="median") * 1e3
            row["fla_rel_err"] = rel(fla_out, ref)
        row["floor_over_triton"] = row["floor_us"] / t_triton

        def chunked(c, bv, warps, prec):
            cfg = {"chunk": c, "block_v": bv, "num_warps": warps, "precision": prec}
            w = pool0.clone()

            def call():
                return gated_delta_rule_chunked_triton(q, k, v, decay, beta, qsl_t, w, slots, init, chunk_size=c,
                                                       block_v=bv, num_warps=warps, precision=prec)
            try:
                o = call()
                us = do_bench(call, warmup=5, rep=30, return_mode="median") * 1e3
            except Exception as e:  # out of shared memory etc.
                return {**cfg, "error": f"{type(e).__name__}: {str(e)[:160]}"}
            return {**cfg, "us": us, "rel_err": rel(o, ref), "state_rel_err": rel(w[slots], ref_pool[slots])}
        grid = [chunked(*cfg) for cfg in CHUNKED]
        best = min((r for r in grid if "us" in r), key=lambda r: r["us"])
        grid.append(chunked(best["chunk"], best["block_v"], best["num_warps"], "ieee"))
        work = pool0.clone()
        default = gated_delta_rule_chunked_triton(q, k, v, decay, beta, qsl_t, work, slots, init)
        default_us = do_bench(lambda: gated_delta_rule_chunked_triton(q, k, v, decay, beta, qsl_t, work, slots, init),
                              warmup=5, rep=30, return_mode="median") * 1e3
        row.update(chunked_grid=grid, chunked_best=best, chunked_default_us=default_us,
                   chunked_default_rel_err=rel(default, ref), floor_over_chunked=row["floor_us"] / best["us"])
        rows.append(row)
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if k != "chunked_grid"}
        print(json.dumps(shown), flush=True)
    rows.append(mixed_step(torch, do_bench, gated_delta_rule_varlen, gated_delta_rule_recurrent_triton,
                           gated_delta_rule_chunked_triton))
    print(json.dumps(rows[-1]), flush=True)
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "fla": chunk_gated_delta_rule is not None,
                "shape": {"Hk": HK, "Hv": HV, "Dk": DK, "Dv": DV, "taps": K_TAPS, "dtype": "bf16"}}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
