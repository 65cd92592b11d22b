"""The expert layer at mixed- and prefill-step sizes over a grid of tiles, each with and without
HALF_TILES (an expert's last block of at most BLOCK_M / 2 rows runs a half-height tile), on a CUDA
GPU: the whole layer (alignment, gate_up, down, top-k sum) per call, each config's output checked
against the shipped config's, beside cuBLAS bmm on the same rows spread evenly over the experts
(a dense batched GEMM: no alignment, no padding) and the weight-read / FLOP floors, and for the shipped
config and bmm the device time of each kernel they launch (torch.profiler).

    python benchmarks/bench_expert_tiles.py --out gpu_out/expert_tiles.json [--M 1024 2048 4096] \
        [--write-configs gpu_out/configs]

--down-tma: instead of the grid, the down GEMM's tiles (DOWN_TILES, the shipped gate_up unchanged) with and without
TMA (config "TMA" under "down": h and the weights through TMA descriptors), each with the down kernel's own device
time, the measure of that switch (and what --write-configs ranks by: the best down time, where it beats the shipped
down tile's by more than 3%).

--write-configs writes the config file of this shape into that folder: the shipped configs, with each
bucket of --M whose best grid config beat the shipped one by more than 3% replaced by it.

Qwen3-30B-A3B's expert shape by default (E=128, D=2048, F=768, top-8, bf16). Times: CUDA-graph
replay (kernels/triton_moe/tune.py's time_calls).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HBM_BYTES_PER_S = 4.8e12
BF16_FLOP_PER_S = 700e12  # the floor's rate (BENCHMARKS.md)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for both GEMMs, GROUP_M 8; each also with HALF_TILES
TILES = [(64, 64, 64, 4, 3), (64, 128, 64, 8, 3), (128, 64, 64, 4, 4), (128, 64, 64, 8, 3),
         (128, 128, 64, 8, 3), (128, 128, 64, 8, 4)]


# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the down GEMM for --down-tma
DOWN_TILES = [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3), (64, 128, 4, 4),
              (256, 128, 8, 3)]


def down_variants(shipped: dict) -> list[tuple[str, dict]]:
    """(name, config) of the shipped gate_up beside each down tile, pointer loads and TMA, HALF_TILES off in down."""
    downs = [("shipped down", dict(shipped.get("down", {}), HALF_TILES=False))]
    downs += [(str(t), {"BLOCK_SIZE_N": t[0], "BLOCK_SIZE_K": t[1], "num_warps": t[2], "num_stages": t[3],
                        "GROUP_SIZE_M": 8, "HALF_TILES": False}) for t in DOWN_TILES]
    out = []
    for name, down in downs:
        out += [(name, dict(shipped, down=down)), (name + " tma", dict(shipped, down=dict(down, TMA=True)))]
    return out


def tile_config(tile, half: bool) -> dict:
    bm, bn, bk, w, s = tile
    cfg = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": 8, "num_warps": w,
           "num_stages": s}
    return dict(cfg, HALF_TILES=True) if half else cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--M", type=int, nargs="+", default=[768, 1024, 1536, 2048, 3072, 4096, 8192])
    p.add_argument("--E", type=int, default=128)
    p.add_argument("--D", type=int, default=2048)
    p.add_argument("--F", type=int, default=768)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--out", default=None)
    p.add_argument("--write-configs", default=None, help="folder for the config file (see above)")
    p.add_argument("--down-tma", action="store_true", help="the down GEMM's tiles with and without TMA (see above)")
    p.add_argument("--grid", action=argparse.BooleanOptionalAction, default=True,
                   help="time the grid of tiles (--no-grid: the shipped config, bmm and their kernels only)")
    args = p.parse_args()

    import torch

    from kernels.triton_moe.config import config_file_name, device_name, get_config, load_configs
    from kernels.triton_moe.fused import _run
    from kernels.triton_moe.tune import kernel_times, make_problem, time_calls, time_events

    E, D, F, K = args.E, args.D, args.F, args.topk
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "E": E, "D": D, "F": F, "topk": K,
           "rows": []}
    name = config_file_name(E, F, device_name(), "bf16")
    configs = dict(load_configs(name) or {})
    for M in args.M:
        x, w13, w2, tw, ti = make_problem(E, D, F, K, M, torch.bfloat16)
        flops = 2 * M * K * 3 * D * F
        floor_us = max((w13.numel() + w2.numel()) * 2 / HBM_BYTES_PER_S, flops / BF16_FLOP_PER_S) * 1e6
        shipped = get_config(M, E, F, K, torch.bfloat16)
        want = _run(x, w13, w2, tw, ti, None, shipped).float()

        def timed(cfg) -> dict:
            try:
                out = _run(x, w13, w2, tw, ti, None, cfg).float()
                err = ((out - want).norm() / want.norm()).item()
                us = time_calls([lambda: _run(x, w13, w2, tw, ti, None, cfg)]) * 1e3
                return {"config": cfg, "us": round(us, 1), "rel_err": err, "ok": err < 1e-2}
            except Exception as e:  # out of shared memory etc.
                return {"config": cfg, "error": f"{type(e).__name__}: {str(e)[-600:]}"}  # a compile error's cause: last

        rows = [dict(timed(shipped), name="shipped")]
        if args.down_tma:
            for variant, cfg in down_variants(shipped):
                row = dict(timed(cfg), name=variant)
                if "us" in row:  # the down kernel's own device time
                    times = kernel_times(lambda: _run(x, w13, w2, tw, ti, None, cfg))
                    row["down_us"] = next((v for k, v in times.items() if k.startswith("down_kernel")), None)
                rows.append(row)
        elif shipped["BLOCK_SIZE_M"] >= 32:
            rows.append(dict(timed(dict(shipped, HALF_TILES=True)), name="shipped half"))
        for tile in TILES if args.grid and not args.down_tma else ():
            for half in (False, True):
                rows.append(dict(timed(tile_config(tile, half)), name=f"{tile}{' half' if half else ''}"))
        m_e = max(1, M * K // E)  # cuBLAS: the same rows, evenly spread
        a = torch.randn(E, m_e, D, dtype=x.dtype, device=x.device)
        hh = torch.randn(E, m_e, F, dtype=x.dtype, device=x.device)
        def bmm_pair():
            return torch.bmm(a, w13.transpose(1, 2)), torch.bmm(hh, w2.transpose(1, 2))

        bmm_us = time_events([bmm_pair], 20) * 1e3
        # where the shipped config's time goes, kernel by kernel, beside bmm's two GEMMs
        split = {"shipped": kernel_times(lambda: _run(x, w13, w2, tw, ti, None, shipped)),
                 "bmm": kernel_times(bmm_pair)}
        # --down-tma: every row has the same gate_up, so the down kernel's own time ranks them, against the shipped
        # down tile's (pointer loads, no half tiles); otherwise the whole call's time, against the shipped config's
        rank, baseline = ("down_us", "shipped down") if args.down_tma else ("us", "shipped")
        ok = [r for r in rows if r.get("ok") and r.get(rank)]
        best = min(ok, key=lambda r: r[rank])
        row = {"M": M, "floor_us": round(floor_us, 1), "bmm_balanced_us": round(bmm_us, 1), "best": best["name"],
               "best_us": best["us"], "shipped_us": rows[0].get("us"), "kernels_us": split, "configs": rows}
        res["rows"].append(row)
        base = next(r for r in rows if r["name"] == baseline)
        if best[rank] < 0.97 * base.get(rank, float("inf")):
            configs[M] = best["config"]
        print(json.dumps({k: v for k, v in row.items() if k not in ("configs", "kernels_us")}), flush=True)
        print("  kernels (µs a call): " + json.dumps(split), flush=True)
        print("  " + "  ".join(f"{r['name']}: {r.get('us', 'ERR')}" + (f" (down {r['down_us']})" if r.get("down_us")
                                                                           else "") for r in rows), flush=True)
        x = w13 = w2 = a = hh = None
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    if args.write_configs:
        Path(args.write_configs).mkdir(parents=True, exist_ok=True)
        (Path(args.write_configs) / name).write_text(json.dumps({str(m): c for m, c in sorted(configs.items())},
                                                                indent=2))


if __name__ == "__main__":
    main()
