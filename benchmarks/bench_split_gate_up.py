"""The split gate_up (config "SPLIT_K": D split over programs, SiLU * up in the down GEMM) at decode
sizes, one GPU, Qwen3-30B-A3B's expert shape (E=128, D=2048, F=768, top-8, bf16).

    python benchmarks/bench_split_gate_up.py --out results/split_gate_up_h200.json \
        --write-config-dir configs_out

The whole expert layer (gate_up, down, top-k sum; one token needs no alignment) is timed as a
CUDA graph of LAYERS calls, each on its own weights so none finds its experts in L2, PDL on,
median of do_bench over replays, per call. At T=1 it sweeps the gate_up tile (BLOCK_N, BLOCK_K,
num_stages), SPLIT_K and the down GEMM's pipeline; the shipped config and the best few are then
timed at every --tokens. --write-config-dir writes the shipped config file with its M=1 bucket
replaced by the best split config, when that beats the shipped one at T=1 (for an engine A/B
through MOE_KERNEL_CONFIG_DIR).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root
from kernels.triton_moe import config as cfgmod  # noqa: E402
from kernels.triton_moe.fused import fused_experts_triton  # noqa: E402

E, D, F, K = 128, 2048, 768, 8
LAYERS = 8
SPLITS = [2, 3, 4, 6]
TILES = [(64, 128, 4), (32, 128, 4), (128, 128, 3), (64, 256, 3)]  # gate_up (BLOCK_N, BLOCK_K, num_stages)
# With a split gate_up the down GEMM also stages fp32 parts of its A tile in shared memory, so
# shallower pipelines than the shipped down's are tried too (None: the shipped one).
DOWNS = [None, {"BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "num_stages": 2},
         {"BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "num_stages": 3}]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--best", type=int, default=4, help="configs of the T=1 sweep timed at every T")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--write-config-dir", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_split_gate_up.py needs a GPU")
    bf16, dev = torch.bfloat16, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = [(torch.randn(E, 2 * F, D, device=dev, generator=g) * D ** -0.5).to(bf16) for _ in range(LAYERS)]
    w2 = [(torch.randn(E, D, F, device=dev, generator=g) * F ** -0.5).to(bf16) for _ in range(LAYERS)]
    shipped = cfgmod.get_config(1, E, F, K, bf16)

    def inputs(T):
        x = torch.randn(T, D, device=dev, generator=g).to(bf16)
        ids = [torch.rand(T, E, device=dev, generator=g).topk(K, dim=-1).indices.to(torch.int32)
               for _ in range(LAYERS)]
        return x, ids, torch.rand(T, K, device=dev, generator=g).softmax(-1)

    def layer_us(cfg, x, ids, wts) -> float:
        def layers():
            return [fused_experts_triton(x, w13[i], w2[i], wts, ids[i], config=cfg) for i in range(LAYERS)]
        layers()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layers()
        return do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3 / LAYERS

    def with_tile(bn, bk, stages, split, down):
        return dict(shipped, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, num_stages=stages, num_warps=4, SPLIT_K=split,
                    down=dict(shipped.get("down", {}), **(down or {})))

    results = {"device": torch.cuda.get_device_name(), "shipped_m1": shipped, "sweep_t1": [], "rows": []}
    with torch.no_grad():
        x, ids, wts = inputs(1)
        ref = fused_experts_triton(x, w13[0], w2[0], wts, ids[0], config=shipped).float()
        sweep = []
        variants = [(tile, 1, None) for tile in TILES] + list(itertools.product(TILES, SPLITS, DOWNS))
        for (bn, bk, stages), split, down in variants:
            cfg = with_tile(bn, bk, stages, split, down)
            try:
                out = fused_experts_triton(x, w13[0], w2[0], wts, ids[0], config=cfg).float()
                err = float((out - ref).norm() / ref.norm())
                us = layer_us(cfg, x, ids, wts)
            except Exception as e:  # a tile the GPU cannot hold (shared memory): skip it
                print(f"skip {bn} {bk} {stages} split {split} down {down}: {type(e).__name__}", flush=True)
                continue
            sweep.append({"config": cfg, "us": us, "rel_err_vs_shipped": err})
            print(f"T=1 BN={bn} BK={bk} stages={stages} split={split} down={down}: {us:.2f} us (rel err {err:.1e})",
                  flush=True)
        results["sweep_t1"] = sweep
        shipped_t1 = layer_us(shipped, x, ids, wts)
        best = sorted(sweep, key=lambda r: r["us"])[:args.best]
        print(f"shipped at T=1: {shipped_t1:.2f} us; best: " +
              "; ".join(f"{r['us']:.2f} us {r['config']['BLOCK_SIZE_N']}/{r['config']['BLOCK_SIZE_K']}/"
                        f"{r['config']['num_stages']} split {r['config']['SPLIT_K']}" for r in best), flush=True)
        for T in args.tokens:
            x, ids, wts = inputs(T)
            row = {"T": T, "shipped_us": layer_us(cfgmod.get_config(T, E, F, K, bf16), x, ids, wts),
                   "best_us": [layer_us(r["config"], x, ids, wts) for r in best]}
            results["rows"].append(row)
            print("T", T, json.dumps(row), flush=True)
    results["best_configs"] = [r["config"] for r in best]
    if args.write_config_dir and best and best[0]["us"] < 0.98 * shipped_t1:
        name = cfgmod.config_file_name(E, F, cfgmod.device_name(), "bf16")
        table = json.loads((cfgmod.CONFIG_DIR / name).read_text())
        table["1"] = best[0]["config"]
        out_dir = Path(args.write_config_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text(json.dumps(table, indent=1))
        results["written"] = str(out_dir / name)
        print("wrote", out_dir / name, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
