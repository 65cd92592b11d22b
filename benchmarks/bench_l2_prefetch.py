"""L2 prefetch (kernels/l2_prefetch.py) at the kernel level, one GPU, Qwen3-30B-A3B shapes (bf16).

    python benchmarks/bench_l2_prefetch.py --out results/l2_prefetch_h200.json

Cases, each timed with the prefetch on and off (its MOE_PREFETCH_* switch) in the same process:
- mechanism: one skinny o_proj GEMM (2048 x 4096, M=1) on a weight that is not in L2, timed after a
  bulk prefetch of that weight (and a pause for it to land) against after the same pause alone;
- experts: the Triton expert layer (align, gate_up, down, top-k sum) at T tokens, a CUDA graph of
  LAYERS calls, each on its own weights (so none is in L2 from the call before), PDL on;
- projections: LAYERS x (qkv 5120 x 2048, then o_proj 2048 x 4096) at M=1, one graph;
- attention: LAYERS x split-KV decode of one sequence of KEYS keys (block tables of a 4096-token
  model), one graph.
Median of do_bench over graph replays, per layer (per call).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
from kernels.l2_prefetch import l2_prefetch_share  # noqa: E402
from kernels.triton_attention.decode import paged_attention_decode_triton  # noqa: E402
from kernels.triton_fused.skinny_gemm import skinny_linear  # noqa: E402
from kernels.triton_moe.fused import fused_experts_triton  # noqa: E402

D, E, F, K = 2048, 128, 768, 8
H, G, HEAD = 32, 4, 128
LAYERS = 8
KEYS = 576
BLOCK = 16


@triton.jit
def _prefetch_kernel(ptr, nbytes):
    l2_prefetch_share(ptr, nbytes, tl.program_id(0), tl.num_programs(0))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_l2_prefetch.py needs a GPU")
    bf16, dev = torch.bfloat16, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def graph_us(fn, calls: int) -> float:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3 / calls

    def switch(site: str, on: bool):
        os.environ[f"MOE_PREFETCH_{site}"] = "1" if on else "0"

    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    rows = []
    with torch.no_grad():
        # mechanism: does a bulk prefetch land the weight in L2?
        ws = [torch.randn(D, 2 * D, device=dev, generator=g).to(bf16) for _ in range(16)]
        x = torch.randn(1, 2 * D, device=dev, generator=g).to(bf16)
        switch("SKINNY", False)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        mech = {}
        for prefetched in (False, True):
            times = []
            for rep in range(64):
                w = ws[rep % len(ws)]
                if prefetched:
                    _prefetch_kernel[(132,)](w, w.numel() * 2)
                torch.cuda._sleep(40_000)  # ~20 us for the prefetch to land
                start.record()
                skinny_linear(x, w)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            mech["after_prefetch_us" if prefetched else "cold_us"] = sorted(times)[len(times) // 2]
        results["mechanism_skinny_o_proj"] = mech
        print("mechanism:", mech, flush=True)
        del ws

        # experts
        w13 = [torch.randn(E, 2 * F, D, device=dev, generator=g).to(bf16) * D ** -0.5 for _ in range(LAYERS)]
        w2 = [torch.randn(E, D, F, device=dev, generator=g).to(bf16) * F ** -0.5 for _ in range(LAYERS)]
        for T in args.tokens:
            xs = torch.randn(T, D, device=dev, generator=g).to(bf16)
            ids = [torch.rand(T, E, device=dev, generator=g).topk(K, dim=-1).indices.to(torch.int32)
                   for _ in range(LAYERS)]
            wts = torch.rand(T, K, device=dev, generator=g).softmax(-1)
            row = {"T": T}
            outs = {}
            for on in (True, False, True, False):
                switch("EXPERTS", on)

                def layers():
                    return [fused_experts_triton(xs, w13[i], w2[i], wts, ids[i]) for i in range(LAYERS)]
                outs[on] = layers()
                row.setdefault(f"experts_{'on' if on else 'off'}_us", []).append(graph_us(layers, LAYERS))
            row["max_abs_diff_on_off"] = max(float((a.float() - b.float()).abs().max())
                                             for a, b in zip(outs[True], outs[False]))
            rows.append(row)
            print("experts", row, flush=True)
        results["experts"] = rows

        # projections at M=1
        wqkv = [torch.randn(5120, D, device=dev, generator=g).to(bf16) for _ in range(LAYERS)]
        wo = [torch.randn(D, 4096, device=dev, generator=g).to(bf16) for _ in range(LAYERS)]
        x1 = torch.randn(1, D, device=dev, generator=g).to(bf16)
        proj = {}
        for on in (True, False, True, False):
            switch("SKINNY", on)

            def projections():
                for i in range(LAYERS):
                    y = skinny_linear(x1, wqkv[i])
                    skinny_linear(y[:, :4096], wo[i])
            proj.setdefault("on_us" if on else "off_us", []).append(graph_us(projections, LAYERS))
        results["projections_qkv_o_m1"] = proj
        print("projections", proj, flush=True)

        # decode attention, one sequence
        num_blocks = 4096 // BLOCK
        caches = [torch.randn(2, num_blocks + 8, BLOCK, G, HEAD, device=dev, generator=g).to(bf16)
                  for _ in range(LAYERS)]
        table = torch.randperm(num_blocks, device=dev, generator=g).to(torch.int32).view(1, -1)
        seq_lens = torch.tensor([KEYS], dtype=torch.int32, device=dev)
        q = torch.randn(1, H, HEAD, device=dev, generator=g).to(bf16)
        attn = {}
        for on in (True, False, True, False):
            switch("ATTN", on)

            def attention():
                for i in range(LAYERS):
                    paged_attention_decode_triton(q, caches[i], table, seq_lens, HEAD ** -0.5)
            attn.setdefault("on_us" if on else "off_us", []).append(graph_us(attention, LAYERS))
        results["attention_b1"] = attn
        print("attention", attn, flush=True)
    for site in ("EXPERTS", "SKINNY", "ATTN"):
        os.environ.pop(f"MOE_PREFETCH_{site}", None)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
