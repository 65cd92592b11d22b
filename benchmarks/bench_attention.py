"""Triton paged attention at Qwen3-30B-A3B attention shapes (H=32, G=4, d=128, bf16, block 16) on
one GPU, against torch SDPA on the same K/V gathered contiguous beforehand (gather not timed) and
against hardware floors (KV bytes at 4.8 TB/s for decode, causal FLOPs at 700 TFLOP/s for prefill).
Mixed steps (decode rows beside one prefill chunk over cached context, in one launch) compare the
varlen prefill kernel with the unified kernel (MOE_UNIFIED_ATTENTION=1): every row in its tiles, the
decode rows in the decode kernel's launch before it, and that launch on a side stream beside it,
against the larger of the bytes floor (each sequence's visible K/V once per KV head, q and out) and
the FLOP floor, and both outputs against the torch reference.

    python benchmarks/bench_attention.py --out results/attention_h200.json [--sweep]

Decode and the unified kernel's mixed steps are timed as CUDA-graph replays (as the model runner runs
them), prefill eagerly; all timings are triton.testing.do_bench medians. --sweep also
times a few prefill tile configs / decode splits / unified tile heights and key tiles.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

H, G, D, S = 32, 4, 128, 16
HBM_BPS = 4.8e12
PEAK_FLOPS = 700e12
DECODE_BATCHES = (1, 32, 256)
DECODE_CONTEXTS = (512, 2048, 8192)
PREFILLS = ((8, 1024), (1, 8192))  # (sequences, new tokens each), no cached context
# (decode rows, their mean context, chunk tokens, tokens cached before the chunk); the chunk is the
# batch's last sequence, as a new prompt's first chunk is scheduled after the running requests.
# (decodes, their mean context, chunk, cached tokens before it): an offline batch's steps, and the
# serving steps at a few requests per second (a few dozen decodes beside a new prompt; one cached
# token keeps the reference on its paged path).
# The chunk alone (no decode rows): the unified kernel's tiles apart from the decode kernel, which --sweep's
# configs also set (BLOCK_N).
MIXED_STEPS = ((256, 600, 512, 1000), (64, 600, 2048, 1000), (16, 400, 512, 1), (32, 400, 512, 1),
               (64, 400, 1024, 1), (0, 0, 512, 1000), (0, 0, 2048, 1000))
# --chunk-rows: the chunk alone beside the target mixed step (`gpu_run.sh unified-tiles`)
CHUNK_STEPS = ((0, 0, 512, 1000), (0, 0, 2048, 1000), (256, 600, 512, 1000))


def paged_cache(torch, lens, seed=0, device="cuda"):
    """Random bf16 cache holding the given context lengths in shuffled blocks.
    Returns (cache [2, N, S, G, d], block tables [B, max_blocks] int32)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    nblk = [-(-L // S) for L in lens]
    N = sum(nblk)
    cache = torch.randn(2, N, S, G, D, device=device, dtype=torch.bfloat16, generator=gen)
    perm = torch.randperm(N, device=device, generator=gen).to(torch.int32)
    tables = torch.zeros(len(lens), max(nblk), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(nblk):
        tables[b, :n] = perm[start:start + n]
        start += n
    return cache, tables


def mixed_case(torch, num_decodes, ctx, chunk, cached, device="cuda"):
    """A mixed step's attention inputs: num_decodes decode rows with contexts ctx +- 20% (seeded) and
    one chunk of `chunk` new tokens over `cached` ones, the batch's last sequence. Returns
    (q [T, H, d], cache, block tables, query_start_loc, seq_lens) on the device, and the context
    lengths and query_start_loc as host lists."""
    gen = torch.Generator().manual_seed(num_decodes * chunk)
    lens = torch.randint(int(ctx * 0.8), int(ctx * 1.2) + 1, (num_decodes,), generator=gen).tolist()
    lens.append(cached + chunk)
    cache, tables = paged_cache(torch, lens, seed=num_decodes + chunk, device=device)
    qsl_host = [0]
    for n in [1] * num_decodes + [chunk]:
        qsl_host.append(qsl_host[-1] + n)
    q = torch.randn(qsl_host[-1], H, D, device=device, dtype=torch.bfloat16)
    qsl = torch.tensor(qsl_host, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return (q, cache, tables, qsl, seq_lens), lens, qsl_host


def gathered_kv(torch, cache, tables, lens):
    """Contiguous K, V [B, G, L, d] of equal-length sequences (for SDPA)."""
    L = lens[0]
    kv = cache[:, tables.long()]  # [2, B, nblk, S, G, d]
    kv = kv.reshape(2, len(lens), -1, G, D)[:, :, :L].transpose(2, 3).contiguous()
    return kv[0], kv[1]


def graph_time(torch, do_bench, fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e-3


def bench_decode(torch, do_bench, F, decode, B, L, num_splits=None):
    cache, tables = paged_cache(torch, [L] * B, seed=B * L)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    scale = D ** -0.5
    t_triton = graph_time(torch, do_bench,
                          lambda: decode(q, cache, tables, lens, scale, out_BHd=out, num_splits=num_splits))
    k, v = gathered_kv(torch, cache, tables, [L] * B)
    q4 = q[:, :, None, :]
    try:
        t_sdpa = graph_time(torch, do_bench,
                            lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
    except RuntimeError:  # a backend that cannot be captured: time it eagerly
        torch.cuda.synchronize()
        t_sdpa = do_bench(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True),
                          warmup=25, rep=100, return_mode="median") * 1e-3
    ref = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)[:, :, 0]
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    floor = 2 * B * L * G * D * 2 / HBM_BPS
    return {"kind": "decode", "B": B, "context": L, "num_splits": num_splits, "triton_us": t_triton * 1e6,
            "sdpa_us": t_sdpa * 1e6, "floor_us": floor * 1e6, "pct_of_floor": 100 * floor / t_triton,
            "rel_err_vs_sdpa": err}


def bench_prefill(torch, do_bench, F, prefill, nseq, n, config=None):
    cache, tables = paged_cache(torch, [n] * nseq, seed=nseq * n)
    T = nseq * n
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, T + 1, n, dtype=torch.int32, device="cuda")
    lens = torch.full((nseq,), n, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    scale = D ** -0.5
    t_triton = do_bench(lambda: prefill(q, cache, tables, qsl, lens, n, scale, out_THd=out, config=config),
                        warmup=10, rep=50, return_mode="median") * 1e-3
    k, v = gathered_kv(torch, cache, tables, [n] * nseq)
    qs = q.view(nseq, n, H, D).transpose(1, 2)  # [nseq, H, n, d]

    def sdpa():
        return [F.scaled_dot_product_attention(qs[i:i + 1], k[i:i + 1], v[i:i + 1], is_causal=True,
                                               scale=scale, enable_gqa=True) for i in range(nseq)]
    t_sdpa = do_bench(sdpa, warmup=10, rep=50, return_mode="median") * 1e-3
    ref = torch.cat(sdpa()).transpose(1, 2).reshape(T, H, D)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    flops = 4 * H * D * nseq * n * (n + 1) / 2  # QK^T and PV over the causal triangle
    floor = flops / PEAK_FLOPS
    return {"kind": "prefill", "seqs": nseq, "new_tokens": n, "config": config, "triton_us": t_triton * 1e6,
            "sdpa_us": t_sdpa * 1e6, "floor_us": floor * 1e6, "pct_of_floor": 100 * floor / t_triton,
            "triton_tflops": flops / t_triton / 1e12, "rel_err_vs_sdpa": err}


def bench_mixed(torch, do_bench, prefill, unified, reference, num_decodes, ctx, chunk, cached,
                block_q=None, config=None):
    """One mixed step: num_decodes decode rows with contexts ctx +- 20% (seeded) and one chunk of
    `chunk` new tokens over `cached` ones, through the prefill kernel and the unified kernel (every
    row in its tiles, and with the decode rows in the decode kernel's launch)."""
    from kernels.attention import AttentionMetadata

    (q, cache, tables, qsl, seq_lens), lens, qsl_host = mixed_case(torch, num_decodes, ctx, chunk, cached)
    T = qsl_host[-1]
    out_p, out_u, out_t = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    scale = D ** -0.5
    max_q = max(1, chunk)
    t_prefill = do_bench(lambda: prefill(q, cache, tables, qsl, seq_lens, max_q, scale, out_THd=out_p),
                         warmup=10, rep=50, return_mode="median") * 1e-3
    # the unified kernel's forms as the model runner runs mixed steps: replayed from a CUDA graph (so the side
    # stream's fork and join cost what they cost in a replay, not an eager launch's host time)
    t_unified = graph_time(torch, do_bench, lambda: unified(q, cache, tables, qsl, seq_lens, scale, out_THd=out_u,
                                                            block_q=block_q, config=config, decodes_apart=False))
    t_apart = graph_time(torch, do_bench, lambda: unified(q, cache, tables, qsl, seq_lens, scale, out_THd=out_t,
                                                          block_q=block_q, config=config, decodes_apart=True))
    out_s = torch.empty_like(q)
    t_stream = graph_time(torch, do_bench, lambda: unified(q, cache, tables, qsl, seq_lens, scale, out_THd=out_s,
                                                           block_q=block_q, config=config, decodes_apart=True,
                                                           decode_stream=True))

    meta = AttentionMetadata(query_start_loc=qsl_host, seq_lens=lens, block_tables_BM=tables,
                             slot_mapping_T=torch.zeros(0, dtype=torch.int64, device="cuda"),
                             decode_seqs=list(range(num_decodes)), prefill_seqs=[num_decodes],
                             decode_token_idx=torch.arange(num_decodes, device="cuda"),
                             decode_seq_lens=seq_lens[:num_decodes].long(), decode_block_tables=tables[:num_decodes])
    ref = reference(q.float(), None, None, cache.float(), meta, scale).float()  # the chunk has cached context
    errs = [((o.float() - ref).norm() / ref.norm()).item() for o in (out_p, out_u, out_t, out_s)]

    keys = sum(lens)  # every sequence's whole context is visible to its last query
    nbytes = 2 * keys * G * D * 2 + 2 * T * H * D * 2
    visible = sum(lens[:num_decodes]) + chunk * cached + chunk * (chunk + 1) // 2  # (query, key) pairs
    flops = 4 * H * D * visible
    floor = max(nbytes / HBM_BPS, flops / PEAK_FLOPS)
    return {"kind": "mixed", "decodes": num_decodes, "decode_context": ctx, "chunk": chunk, "cached": cached,
            "tokens": T, "block_q": block_q, "config": config, "prefill_us": t_prefill * 1e6,
            "unified_us": t_unified * 1e6, "unified_decodes_apart_us": t_apart * 1e6, "speedup": t_prefill / t_unified,
            "unified_decode_stream_us": t_stream * 1e6, "rel_err_unified_decode_stream_vs_torch": errs[3],
            "bytes_read_floor": nbytes, "rel_err_unified_decodes_apart_vs_torch": errs[2],
            "bytes_floor_us": nbytes / HBM_BPS * 1e6, "flops_floor_us": flops / PEAK_FLOPS * 1e6,
            "floor_us": floor * 1e6, "pct_of_floor": 100 * floor / t_unified,
            "rel_err_prefill_vs_torch": errs[0], "rel_err_unified_vs_torch": errs[1]}


SWEEP_PREFILL = [{"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
                 for m, n, w, s in ((64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 2),
                                    (64, 128, 4, 2), (128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3),
                                    (64, 32, 4, 3), (128, 32, 8, 3))]
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32)
# Unified kernel: (rows per tile, i.e. block_q * H/G; BLOCK_N, num_warps, num_stages).
SWEEP_UNIFIED = [(rows, {"BLOCK_N": n, "num_warps": w, "num_stages": st})
                 for rows, n, w, st in ((16, 64, 4, 2), (16, 32, 4, 3), (16, 128, 4, 2), (32, 64, 4, 2),
                                        (64, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2),
                                        (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (64, 32, 4, 4),
                                        (64, 64, 8, 3), (128, 64, 8, 3), (64, 32, 4, 2), (64, 16, 4, 3))]


def pick_unified_tile(results: list[dict], margin: float = 0.96) -> str | None:
    """From a --sweep's rows: the unified kernel's (BLOCK_N, num_warps, num_stages) at the default 64-row
    tiles that is fastest on the chunk-alone rows, as MOE_UNIFIED_TILE's "N,W,S", when it takes less
    than `margin` of the default's time on every one of them; else None."""
    alone = [r for r in results if r.get("kind") == "mixed" and r["decodes"] == 0]
    base = {r["chunk"]: r["unified_us"] for r in alone if r["config"] is None}
    times: dict[tuple, dict] = {}
    for r in alone:
        if r["config"] is not None and r["block_q"] == 64 // (H // G):
            c = r["config"]
            times.setdefault((c["BLOCK_N"], c["num_warps"], c["num_stages"]), {})[r["chunk"]] = r["unified_us"]
    better = [(sum(t[c] / base[c] for c in base), tile) for tile, t in times.items()
              if base and t.keys() == base.keys() and all(t[c] < margin * base[c] for c in base)]
    return ",".join(map(str, min(better)[1])) if better else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--sweep", action="store_true", help="also time prefill tile configs / decode splits")
    parser.add_argument("--mixed-only", action="store_true", help="only the mixed steps")
    parser.add_argument("--chunk-rows", action="store_true",
                        help="of the mixed steps only the chunk alone (512 and 2048 tokens) and the target step")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root, for `kernels`

    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from kernels.attention import paged_attention_torch
    from kernels.triton_attention.decode import paged_attention_decode_triton
    from kernels.triton_attention.prefill import paged_attention_prefill_triton
    from kernels.triton_attention.unified import unified_attention_triton

    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a GPU")
    torch.manual_seed(0)
    rows = []
    for B in () if args.mixed_only else DECODE_BATCHES:
        for L in DECODE_CONTEXTS:
            rows.append(bench_decode(torch, do_bench, F, paged_attention_decode_triton, B, L))
            if args.sweep and B * L <= 32 * 8192:
                rows += [bench_decode(torch, do_bench, F, paged_attention_decode_triton, B, L, p)
                         for p in SWEEP_SPLITS]
            torch.cuda.empty_cache()
    for nseq, n in () if args.mixed_only else PREFILLS:
        rows.append(bench_prefill(torch, do_bench, F, paged_attention_prefill_triton, nseq, n))
        if args.sweep:
            rows += [bench_prefill(torch, do_bench, F, paged_attention_prefill_triton, nseq, n, c)
                     for c in SWEEP_PREFILL]
    mixed = []
    for step in CHUNK_STEPS if args.chunk_rows else MIXED_STEPS:
        kernels = (paged_attention_prefill_triton, unified_attention_triton, paged_attention_torch)
        mixed.append(bench_mixed(torch, do_bench, *kernels, *step))
        if args.sweep:
            mixed += [bench_mixed(torch, do_bench, *kernels, *step, block_q=max(1, r // (H // G)), config=c)
                      for r, c in SWEEP_UNIFIED]
        torch.cuda.empty_cache()
    print(f"{'case':<34}{'triton us':>11}{'sdpa us':>11}{'floor us':>10}{'% floor':>9}{'rel err':>10}")
    for r in rows:
        if r["kind"] == "decode":
            name = f"decode B={r['B']} L={r['context']} splits={r['num_splits']}"
        else:
            cfg = "" if r["config"] is None else " " + "/".join(str(v) for v in r["config"].values())
            name = f"prefill {r['seqs']}x{r['new_tokens']}{cfg}"
        print(f"{name:<34}{r['triton_us']:>11.1f}{r['sdpa_us']:>11.1f}{r['floor_us']:>10.1f}"
              f"{r['pct_of_floor']:>9.1f}{r['rel_err_vs_sdpa']:>10.2e}")
    print(f"\n{'mixed step':<48}{'prefill us':>11}{'unified us':>11}{'dec apart':>10}{'side str':>9}{'speedup':>8}"
          f"{'floor us':>10}"
          f"{'% floor':>9}{'err pre':>10}{'err uni':>10}")
    for r in mixed:
        cfg = "" if r["config"] is None else f" bq={r['block_q']} " + "/".join(str(v) for v in r["config"].values())
        name = f"{r['decodes']}x{r['decode_context']} + {r['chunk']}@{r['cached']}{cfg}"
        print(f"{name:<48}{r['prefill_us']:>11.1f}{r['unified_us']:>11.1f}{r['unified_decodes_apart_us']:>10.1f}"
              f"{r['unified_decode_stream_us']:>9.1f}"
              f"{r['speedup']:>8.2f}{r['floor_us']:>10.1f}"
              f"{r['pct_of_floor']:>9.1f}{r['rel_err_prefill_vs_torch']:>10.2e}{r['rel_err_unified_vs_torch']:>10.2e}")
    rows += mixed
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "shape": {"H": H, "G": G, "d": D, "block": S, "dtype": "bf16"}}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
