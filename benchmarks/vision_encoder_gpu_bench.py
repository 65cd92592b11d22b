"""Llama-4 vision tower forward time in both `mm_encoder_tp_mode`s ("weights": linears split over
the TP ranks; "data": weights replicated, tiles split over the ranks and the features all-gathered).

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/vision_encoder_gpu_bench.py \
        --output-json gpu_out/vision_tp2.json                                    # TP=2, two GPUs
    python benchmarks/vision_encoder_gpu_bench.py --output-json gpu_out/vision_tp1.json   # TP=1 baseline
    torchrun --nproc-per-node 2 benchmarks/vision_encoder_gpu_bench.py --device cpu --tiny  # CPU smoke (gloo)

Model: Llama-4 Scout's vision tower at real size (SCOUT_VISION: 34 layers of hidden 1408, 16 heads,
336-pixel tiles -> 144 features of the text hidden 5120 per tile), random weights (no checkpoint):
every checkpoint tensor is drawn whole from a generator seeded by (--seed, its name) on the device
and handed to the parameter's own loader, so every rank and both modes hold the same values and
"weights" mode slices them exactly as checkpoint loading does. --tiny: a 2-layer tower of 56-pixel
tiles (the unit tests' shape).

Workload: for each --batches B, B images of --tiles-per-image tiles (Llama-4's 4 tiles + the global
view = 5), random pixels. Timed: `Llama4VisionEncoder.forward` (tower + projector, and in "data"
mode the padding and the all-gather) with CUDA events after --warmup runs, --iters runs; the ranks
start each run together and a run's time is the slowest rank's; reported is the median over runs.

Check: the features of the first batch in both modes (max abs diff and ||a - b|| / ||b||, in the
run's dtype); beyond --check-tol the run fails (exit 1) after writing the JSON. Any error fails the
run (non-zero exit; torchrun reports the rank).
Legend: N tiles, Q features per tile, E text hidden.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import zlib

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script (torchrun): this checkout's packages
    sys.path.insert(0, ROOT)

from models.llama4_vision import MM_ENCODER_TP_MODES, Llama4VisionConfig, Llama4VisionEncoder  # noqa: E402
from models.parallel.state import ParallelLayout, init_parallel_state, reset_parallel_state  # noqa: E402

# Llama-4 Scout (meta-llama/Llama-4-Scout-17B-16E) vision_config; text hidden from its text_config.
SCOUT_VISION = dict(hidden_size=1408, intermediate_size=5632, num_hidden_layers=34, num_attention_heads=16,
                    image_size=336, patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=4096,
                    projector_output_dim=4096, vision_output_dim=4096, text_hidden_size=5120)
TINY_VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                   patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=48, projector_output_dim=48,
                   vision_output_dim=48, text_hidden_size=64)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CHECK_TOL = {"bf16": 5e-2, "fp32": 1e-4}  # ||weights - data|| / ||data||: reduction orders differ


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer tower of 56-pixel tiles (smoke test)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="images per batch (default 8 16 32 64; "
                                                                        "--tiny: 1 3)")
    p.add_argument("--tiles-per-image", type=int, default=5)
    p.add_argument("--modes", nargs="+", choices=MM_ENCODER_TP_MODES, default=list(MM_ENCODER_TP_MODES))
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=None, help="default 3 (--tiny: 1)")
    p.add_argument("--iters", type=int, default=None, help="default 10 (--tiny: 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-tol", type=float, default=None, help="default by dtype: " + str(CHECK_TOL))
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    args.batches = args.batches or ([1, 3] if args.tiny else [8, 16, 32, 64])
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.iters = args.iters or (2 if args.tiny else 10)
    args.check_tol = args.check_tol if args.check_tol is not None else CHECK_TOL[args.dtype]
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu for a smoke run)")
    if min(args.batches) < 1 or args.tiles_per_image < 1 or args.iters < 1:
        p.error("--batches, --tiles-per-image and --iters must be >= 1")
    return args


@contextlib.contextmanager
def process_group(device_type: str):
    """Under torchrun (WORLD_SIZE set): the default group (NCCL on GPUs, gloo on the CPU) and the
    TP group of all ranks; yields (this rank's device, rank, TP size). Alone: no group, TP 1."""
    if "WORLD_SIZE" not in os.environ:
        yield torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu"), 0, 1
        return
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (not available on the lent hosts)
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local)
    else:  # ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        init_parallel_state(ParallelLayout(tp=world), rank)
        yield (torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")), rank, world
    finally:
        reset_parallel_state()
        dist.destroy_process_group()


def _scale(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of a tensor: activations stay O(1) through the tower (LayerNorm weights near 1)."""
    if "norm" in name and name.endswith("weight"):
        return 1.0, 0.1
    if name.endswith(("class_embedding", "positional_embedding_vlm")):
        return 0.0, 0.5
    if name.endswith("bias"):
        return 0.0, 0.02
    return 0.0, shape[1] ** -0.5  # linear [out, in]


@torch.no_grad()
def fill_random(encoder: torch.nn.Module, seed: int, device: torch.device) -> None:
    """Each checkpoint tensor drawn whole (seeded by its name) and copied through the parameter's
    loader: a rank of "weights" mode keeps its slice, "data" mode everything."""
    for name, param in encoder.named_parameters():
        loader = param.param_loader
        for shard, expert in loader.pieces():
            shape = tuple(loader.ckpt_shape(shard, expert))
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            mean, std = _scale(name, shape)
            full = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std + mean
            loader.load(param, full.to(param.dtype), shard, expert)


def build_encoder(vision: dict, mode: str, dtype: torch.dtype, device: torch.device, seed: int):
    cfg = Llama4VisionConfig(**vision, mm_encoder_tp_mode=mode)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            encoder = Llama4VisionEncoder(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    fill_random(encoder, seed, device)
    return encoder


def make_pixels(num_tiles: int, image_size: int, seed: int, device: torch.device, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(num_tiles, 3, image_size, image_size, generator=gen, device=device).to(dtype)


def _sync(device: torch.device, world: int) -> None:
    """Wait for this rank's device, then for every rank (a tiny all-reduce: works on NCCL and gloo)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if world > 1:
        dist.all_reduce(torch.zeros(1, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)


@torch.inference_mode()
def time_forward(encoder, pixels, warmup: int, iters: int, device: torch.device, world: int) -> list[float]:
    """ms per forward, each the slowest rank's."""
    for _ in range(warmup):
        encoder(pixels)
    times = []
    for _ in range(iters):
        _sync(device, world)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            encoder(pixels)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            encoder(pixels)
            times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run(args, device: torch.device, rank: int, world: int) -> dict:
    vision = TINY_VISION if args.tiny else SCOUT_VISION
    dtype = DTYPES[args.dtype]
    results, check_features = {}, {}
    for mode in args.modes:
        encoder = build_encoder(vision, mode, dtype, device, args.seed)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rows = []
        for images in args.batches:
            tiles = images * args.tiles_per_image
            pixels = make_pixels(tiles, vision["image_size"], args.seed + images, device, dtype)
            ms = time_forward(encoder, pixels, args.warmup, args.iters, device, world)
            med = statistics.median(ms)
            rows.append(dict(images=images, tiles=tiles, median_ms=round(med, 3), min_ms=round(min(ms), 3),
                             images_per_s=round(images / med * 1e3, 2), tiles_per_s=round(tiles / med * 1e3, 2),
                             all_ms=[round(x, 3) for x in ms]))
            if rank == 0:
                print(f"[{mode}] {images} images ({tiles} tiles): median {med:.2f} ms, "
                      f"{rows[-1]['images_per_s']} images/s, {rows[-1]['tiles_per_s']} tiles/s", flush=True)
        with torch.inference_mode():
            first = make_pixels(args.batches[0] * args.tiles_per_image, vision["image_size"],
                                args.seed + args.batches[0], device, dtype)
            features_NE = encoder(first).float()
        if not torch.isfinite(features_NE).all():
            raise RuntimeError(f"mode {mode!r}: non-finite features")
        check_features[mode] = features_NE.cpu()
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        results[mode] = dict(rows=rows, peak_memory_gib=None if peak is None else round(peak, 2))
        del encoder
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report = dict(tp_size=world, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  dtype=args.dtype, tiny=args.tiny, vision_config=vision, tiles_per_image=args.tiles_per_image,
                  tokens_per_tile=Llama4VisionConfig(**vision).tokens_per_tile, warmup=args.warmup,
                  iters=args.iters, torch=torch.__version__, results=results)
    if {"weights", "data"} <= set(check_features):
        a, b = check_features["weights"], check_features["data"]
        rel = ((a - b).norm() / b.norm()).item()
        report["check"] = dict(images=args.batches[0], max_abs_diff=(a - b).abs().max().item(), rel_diff=rel,
                               feature_abs_mean=b.abs().mean().item(), tol=args.check_tol, ok=rel <= args.check_tol)
        report["data_over_weights_speedup"] = {
            str(w["images"]): round(w["median_ms"] / d["median_ms"], 3)
            for w, d in zip(results["weights"]["rows"], results["data"]["rows"])}
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    with process_group(args.device) as (device, rank, world):
        report = run(args, device, rank, world)
    if rank == 0:
        text = json.dumps(report, indent=1)
        print(text)
        if "check" in report:
            c = report["check"]
            print(f"check weights vs data ({c['images']} images): max abs diff {c['max_abs_diff']:.4g}, "
                  f"rel {c['rel_diff']:.3g} (tol {c['tol']}): {'ok' if c['ok'] else 'FAILED'}", flush=True)
        if args.output_json:
            os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
            with open(args.output_json, "w") as f:
                f.write(text + "\n")
    # Every rank computed the same features: all ranks agree on the exit status.
    return 1 if not report.get("check", {"ok": True})["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
