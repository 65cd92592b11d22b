"""The decode-step kernels that replace others, each against what it replaces, at Qwen3-30B-A3B
shapes (D=2048, E=128, F=768, K=8, vocabulary 151,936, bf16) on one GPU, timed as CUDA graphs of
REPEAT back-to-back calls (as inside a decode step's graph, PDL on), divided by REPEAT.

Legend: T tokens, R = T * K routed rows.

    python benchmarks/bench_decode_fusions.py --out results/decode_fusions_h200.json

Cases:
- align: the ranked alignment (many programs, no atomics) against the one-program path, at the
  BLOCK_M the expert kernels use for T;
- topk_sum_norm: the MoE layer's top-k sum inside the next RMSNorm (rms_norm_topk_sum_triton)
  against moe_sum then the RMSNorm with the residual;
- lm_head: the LM head GEMM (what the decode graphs now hold), for its share of a step.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

D, E, F, K, VOCAB = 2048, 128, 768, 8, 151936


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 8, 32, 64, 128, 256, 512])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root

    import torch
    from triton.testing import do_bench

    from benchmarks.bench_fused import REPEAT, time_us

    def graph_us(fn) -> float:  # T=0 below bench_fused's graph limit: a CUDA graph of REPEAT calls at every T
        return time_us(torch, do_bench, fn, 0)
    from kernels.triton_fused.moe_sum import moe_sum
    from kernels.triton_fused.rms_norm import rms_norm_topk_sum_triton, rms_norm_triton
    from kernels.triton_moe.align import align_tokens
    from kernels.triton_moe.config import get_config

    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_fusions.py needs a GPU")
    bf16, dev = torch.bfloat16, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    w_norm = 1 + 0.3 * torch.randn(D, device=dev, generator=g).to(bf16)
    w_lm = torch.randn(VOCAB, D, device=dev, generator=g).to(bf16) * D ** -0.5
    rows = []
    with torch.no_grad():
        for T in args.tokens:
            ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=-1).indices.to(torch.int32)
            bm = get_config(T, E, F, K, bf16)["BLOCK_SIZE_M"]
            row = {"T": T, "block_m": bm}
            if T > 1:  # one token needs no alignment launch
                for path in ("ranked", "small"):
                    row[f"align_{path}_us"] = graph_us(lambda p=path: align_tokens(ids, E, bm, path=p))
                ranked, small = align_tokens(ids, E, bm, path="ranked"), align_tokens(ids, E, bm, path="small")
                row["align_same_blocks"] = bool(torch.equal(ranked[1], small[1]) and torch.equal(ranked[2], small[2]))
            y = torch.randn(T, K, D, device=dev, generator=g).to(bf16)
            res = torch.randn(T, D, device=dev, generator=g).to(bf16)
            row["topk_sum_norm_us"] = graph_us(lambda: rms_norm_topk_sum_triton(y, w_norm, 1e-6, res))
            row["moe_sum_then_norm_us"] = graph_us(
                torch, do_bench, lambda: rms_norm_triton(moe_sum(y), w_norm, 1e-6, res))
            fused, two = rms_norm_topk_sum_triton(y, w_norm, 1e-6, res), rms_norm_triton(moe_sum(y), w_norm, 1e-6, res)
            row["topk_sum_norm_equal"] = bool(torch.equal(fused[1], two[1]) and torch.equal(fused[0], two[0]))
            h = torch.randn(T, D, device=dev, generator=g).to(bf16)
            row["lm_head_graph_us"] = graph_us(lambda: torch.nn.functional.linear(h, w_lm))
            rows.append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "repeat_in_graph": REPEAT,
                "shape": {"D": D, "E": E, "F": F, "K": K, "vocab": VOCAB, "dtype": "bf16"}}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
