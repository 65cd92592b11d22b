"""FP8 KV cache (kv_cache_dtype="fp8" / "fp8_e5m2") against bf16 on one GPU, in one JSON:

  blocks     KV blocks the engine allocates for the same gpu_memory_utilization, bf16 vs fp8, on a
             Qwen3-30B-A3B-shaped model cut to 2 layers (dummy weights, eager: no graphs needed).
  kernels    decode-attention kernel time, bf16 cache vs fp8 (e4m3 and e5m2) caches, as CUDA-graph
             replays (triton.testing.do_bench medians): the split-KV GQA decode at Qwen3-30B-A3B's
             32 query / 4 KV heads, d 128, and MLA's absorbed decode at DeepSeek-V3's 128 heads,
             R 512 + P 64, each at 64 and 256 sequences x 1k and 4k context (block 16), beside the KV
             bytes each reads at 4.8 TB/s; the KV write (256 tokens) too. Every kernel's output is
             checked against the torch reference (kernels/attention.py, kernels/mla_attention.py) on
             the same cache first; a check that fails stops the run.
  agreement  greedy tokens of engine runs with fp8 KV vs bf16 KV, with CUDA graphs: 64 prompts x 128
             tokens on small random Qwen3-MoE (GQA) and DeepSeek-V3 (MLA) checkpoints in bf16; the
             fraction of equal tokens position by position and of the common prefix, beside a bf16
             run with the prompts in reverse order (the noise of batch composition alone).

    python benchmarks/bench_kv_fp8.py --out kv_fp8_h200.json [--parts blocks,kernels,agreement]

About 2-3 minutes on an H200, most of it Triton compiles and the engine starts.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repo root: kernels, models, moe, tests (the checkpoint factories)

import torch  # noqa: E402

H, G, D, S = 32, 4, 128, 16
MLA_H, MLA_R, MLA_P = 128, 512, 64
HBM_BPS = 4.8e12
BATCHES = (64, 256)
CONTEXTS = (1024, 4096)
CHECKED_SEQS = 8  # sequences of each batch checked against the reference
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def _graph_us(do_bench, fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3


def _tables(B: int, L: int, gen) -> tuple[torch.Tensor, int]:
    per = -(-L // S)
    N = B * per
    perm = torch.randperm(N, device="cuda", generator=gen).to(torch.int32)
    return perm.view(B, per).contiguous(), N


def _quantized(x: torch.Tensor, name: str) -> tuple[torch.Tensor, float]:
    """x in an FP8 cache with a calibrated per-tensor scale (amax / fp8 max), as a checkpoint's."""
    from kernels.attention import quantize_kv
    dtype = FP8[name]
    scale = x.float().abs().amax().item() / torch.finfo(dtype).max
    return quantize_kv(x, dtype, scale), scale


def _decode_meta(tables, lens, n):
    from kernels.attention import AttentionMetadata
    lens_host = lens[:n].tolist()
    return AttentionMetadata(query_start_loc=list(range(n + 1)), seq_lens=lens_host, block_tables_BM=tables[:n],
                             slot_mapping_T=torch.zeros(0, dtype=torch.int64, device="cuda"),
                             decode_seqs=list(range(n)), prefill_seqs=[],
                             decode_token_idx=torch.arange(n, device="cuda"), decode_seq_lens=lens[:n].long(),
                             decode_block_tables=tables[:n])


def bench_gqa_decode(do_bench, B: int, L: int) -> list[dict]:
    from kernels.attention import paged_attention_torch
    from kernels.triton_attention.decode import paged_attention_decode_triton

    gen = torch.Generator(device="cuda").manual_seed(B * L)
    tables, N = _tables(B, L, gen)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    base = torch.randn(2, N, S, G, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = D ** -0.5
    rows = []
    for name in ("bf16", *FP8):
        if name == "bf16":
            cache, ks, vs = base, 1.0, 1.0
        else:
            (k8, ks), (v8, vs) = _quantized(base[0], name), _quantized(base[1], name)
            cache = torch.stack((k8, v8))
        kw = {} if name == "bf16" else {"k_scale": ks, "v_scale": vs}
        out = torch.empty_like(q)
        decode = lambda c=cache, o=out, kw=kw: paged_attention_decode_triton(  # noqa: E731
            q, c, tables, lens, scale, out_BHd=o, **kw)
        decode()
        n = CHECKED_SEQS
        ref = paged_attention_torch(q[:n], None, None, cache, _decode_meta(tables, lens, n), scale, **kw)
        err = _rel(out[:n], ref)
        if err > 2e-2:
            raise SystemExit(f"GQA decode {name} B={B} L={L}: rel err {err:.3e} against the reference")
        us = _graph_us(do_bench, decode)
        nbytes = 2 * B * L * G * D * cache.element_size()
        rows.append({"kernel": "gqa_decode", "kv": name, "B": B, "context": L, "us": us, "kv_bytes": nbytes,
                     "floor_us": nbytes / HBM_BPS * 1e6, "pct_of_floor": 100 * nbytes / HBM_BPS * 1e6 / us,
                     "rel_err_vs_reference": err, "k_scale": ks, "v_scale": vs})
    bf16_us = rows[0]["us"]
    for r in rows:
        r["speedup_vs_bf16"] = bf16_us / r["us"]
    return rows


def bench_mla_decode(do_bench, B: int, L: int) -> list[dict]:
    from kernels.attention import AttentionMetadata
    from kernels.mla_attention import mla_absorbed_torch
    from kernels.triton_attention.mla_decode import mla_decode_triton

    gen = torch.Generator(device="cuda").manual_seed(B * L + 1)
    tables, N = _tables(B, L, gen)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    C = MLA_R + MLA_P
    base = torch.randn(N, S, C, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(B, MLA_H, C, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = 192 ** -0.5
    rows = []
    for name in ("bf16", *FP8):
        cache, s = (base, 1.0) if name == "bf16" else _quantized(base, name)
        kw = {} if name == "bf16" else {"kv_scale": s}
        out = torch.empty(B, MLA_H, MLA_R, device="cuda", dtype=torch.bfloat16)
        decode = lambda c=cache, o=out, kw=kw: mla_decode_triton(q, c, tables, lens, scale, MLA_R, out_BHR=o,  # noqa: E731
                                                                 **kw)
        decode()
        n = CHECKED_SEQS
        meta = AttentionMetadata(list(range(n + 1)), [L] * n, tables[:n], torch.empty(0), list(range(n)), [],
                                 decode_token_idx=torch.arange(n, device="cuda"), decode_seq_lens=lens[:n].long(),
                                 decode_block_tables=tables[:n].long())
        ref = torch.zeros(n, MLA_H, MLA_R, device="cuda", dtype=torch.float32)
        mla_absorbed_torch(q[:n].float(), None, cache, meta, [], True, scale, ref, s)
        err = _rel(out[:n], ref)
        if err > 2e-2:
            raise SystemExit(f"MLA decode {name} B={B} L={L}: rel err {err:.3e} against the reference")
        us = _graph_us(do_bench, decode)
        nbytes = B * L * C * cache.element_size()
        rows.append({"kernel": "mla_decode", "kv": name, "B": B, "context": L, "us": us, "kv_bytes": nbytes,
                     "floor_us": nbytes / HBM_BPS * 1e6, "pct_of_floor": 100 * nbytes / HBM_BPS * 1e6 / us,
                     "rel_err_vs_reference": err, "kv_scale": s})
    bf16_us = rows[0]["us"]
    for r in rows:
        r["speedup_vs_bf16"] = bf16_us / r["us"]
    return rows


def bench_write(do_bench, T: int = 256) -> list[dict]:
    from kernels.attention import write_kv_cache
    from kernels.triton_attention.kv_cache import write_kv_cache_triton

    gen = torch.Generator(device="cuda").manual_seed(3)
    N = 4 * T
    k = torch.randn(T, G, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(T, G, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    slots = torch.randperm(N * S, device="cuda", generator=gen)[:T]
    rows = []
    for name in ("bf16", *FP8):
        dtype = torch.bfloat16 if name == "bf16" else FP8[name]
        kw = {} if name == "bf16" else {"k_scale": 0.02, "v_scale": 0.01}
        cache = torch.zeros(2, N, S, G, D, device="cuda", dtype=dtype)
        write_kv_cache_triton(k, v, cache, slots, **kw)
        want = torch.zeros(2, N, S, G, D, dtype=dtype)
        write_kv_cache(k.cpu(), v.cpu(), want, slots.cpu(), **kw)
        if not torch.equal(cache.cpu().view(torch.uint8), want.view(torch.uint8)):
            raise SystemExit(f"KV write {name}: the cache differs from the reference's bytes")
        us = _graph_us(do_bench, lambda: write_kv_cache_triton(k, v, cache, slots, **kw))
        rows.append({"kernel": "kv_write", "kv": name, "tokens": T, "us": us, "bytes_equal_reference": True})
    return rows


# ---- engine runs ----------------------------------------------------------------------------------
def _qwen3_cut(path: str, layers: int = 2) -> str:
    from moe.bench.common import QWEN3_30B_A3B
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**QWEN3_30B_A3B, "num_hidden_layers": layers}, f)
    return path


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def blocks(tmp: str) -> dict:
    from moe import LLM
    path = _qwen3_cut(os.path.join(tmp, "qwen3_cut"))
    out = {"model": "Qwen3-30B-A3B shape, 2 layers, dummy bf16 weights", "gpu_memory_utilization": 0.5}
    for kv in ("auto", "fp8", "fp8_e5m2"):
        t = time.perf_counter()
        with LLM(path, device="cuda", load_format="dummy", max_model_len=4096, gpu_memory_utilization=0.5,
                 enforce_eager=True, kv_cache_dtype=kv) as llm:
            runner = llm.llm_engine.executor.runner
            # kv_cache_gib: the memory the profile left the cache (an engine started after another in
            # one process may find a little less free, whatever its cache dtype)
            out[kv] = {"num_blocks": runner.num_kv_blocks, "bytes_per_block": runner.kv_cache_bytes_per_block(),
                       "kv_cache_gib": runner.num_kv_blocks * runner.kv_cache_bytes_per_block() / 2**30,
                       "cache_dtype": str(runner.kv_caches[0].dtype).removeprefix("torch."),
                       "start_s": time.perf_counter() - t}
        _free()
        print(f"blocks {kv}: {out[kv]}", flush=True)
    for kv in FP8:
        out[f"{kv}_over_bf16"] = out[kv]["num_blocks"] / out["auto"]["num_blocks"]
        out[f"{kv}_blocks_per_byte_over_bf16"] = out["auto"]["bytes_per_block"] / out[kv]["bytes_per_block"]
    return out


def _prompts(n: int, vocab: int, seed: int = 0) -> list[dict]:
    import random
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(rng.randrange(16, 257))]} for _ in range(n)]


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    n = sum(len(x) for x in a)
    equal = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b))
    return {"equal_tokens": equal / n, "common_prefix": prefix / n, "sequences_identical":
            sum(s == t for s, t in zip(a, b)) / len(a)}


def agreement(tmp: str, num_prompts: int = 64, max_tokens: int = 128) -> dict:
    from moe import LLM, SamplingParams
    from tests.factories import make_qwen3_moe_checkpoint
    from tests.factories_deepseek import make_deepseek_v3_checkpoint

    ckpts = {
        "qwen3_moe": make_qwen3_moe_checkpoint(
            os.path.join(tmp, "qwen3_small"), hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
            head_dim=128, num_hidden_layers=4, moe_intermediate_size=128, intermediate_size=512, num_experts=16,
            num_experts_per_tok=4, vocab_size=4096, max_position_embeddings=1024, mlp_only_layers=[],
            initializer_range=0.05),
        "deepseek_v3": make_deepseek_v3_checkpoint(os.path.join(tmp, "dsv3_small"), max_position_embeddings=1024),
    }
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = {"prompts": num_prompts, "max_tokens": max_tokens}
    for family, path in ckpts.items():
        runs, res = {}, {}
        for kv in ("auto", "fp8", "fp8_e5m2"):
            with LLM(path, device="cuda", dtype="bfloat16", max_model_len=512, kv_cache_dtype=kv,
                     gpu_memory_utilization=0.3, max_num_seqs=64,
                     cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64]) as llm:
                prompts = _prompts(num_prompts, llm.llm_engine.model_config.vocab_size)
                runs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                if kv == "auto":  # the noise floor: the same cache, the batch in another order
                    rev = llm.generate(prompts[::-1], params, use_tqdm=False)
                    res["bf16_reordered_vs_bf16"] = _agreement(runs[kv], [o.outputs[0].token_ids for o in rev][::-1])
                res.setdefault("graphs", llm.llm_engine.executor.runner.graphs is not None)
            _free()
        for kv in FP8:
            res[f"{kv}_vs_bf16"] = _agreement(runs["auto"], runs[kv])
        out[family] = res
        print(f"agreement {family}: {json.dumps(res)}", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--parts", default="blocks,kernels,agreement", help="comma-separated: blocks, kernels, "
                        "agreement")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not torch.cuda.is_available():
        raise SystemExit("bench_kv_fp8.py needs a CUDA GPU")
    from triton.testing import do_bench

    t0 = time.perf_counter()
    results = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "gqa_shape": {"H": H, "G": G, "d": D, "block": S},
                        "mla_shape": {"H": MLA_H, "R": MLA_R, "P": MLA_P, "block": S}}}
    with tempfile.TemporaryDirectory() as tmp:
        if "kernels" in parts:
            rows = bench_write(do_bench)
            for B in BATCHES:
                for L in CONTEXTS:
                    rows += bench_gqa_decode(do_bench, B, L)
                    _free()
                    rows += bench_mla_decode(do_bench, B, L)
                    _free()
            results["kernels"] = rows
            print(f"{'kernel':<12}{'kv':<10}{'B':>5}{'ctx':>6}{'us':>10}{'floor us':>10}{'% floor':>9}"
                  f"{'x bf16':>8}{'rel err':>10}")
            for r in rows:
                if r["kernel"] == "kv_write":
                    print(f"{'kv_write':<12}{r['kv']:<10}{r['tokens']:>5}{'':>6}{r['us']:>10.1f}")
                    continue
                print(f"{r['kernel']:<12}{r['kv']:<10}{r['B']:>5}{r['context']:>6}{r['us']:>10.1f}"
                      f"{r['floor_us']:>10.1f}{r['pct_of_floor']:>9.1f}{r['speedup_vs_bf16']:>8.2f}"
                      f"{r['rel_err_vs_reference']:>10.2e}", flush=True)
        if "blocks" in parts:
            results["blocks"] = blocks(tmp)
        if "agreement" in parts:
            results["agreement"] = agreement(tmp)
    results["meta"]["wall_s"] = time.perf_counter() - t0
    print(f"done in {results['meta']['wall_s']:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
