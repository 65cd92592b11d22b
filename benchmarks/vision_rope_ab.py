"""A/B of the vision tower's 2-D RoPE on one GPU: the Triton rotary kernel (as built) against the
torch reference path (`apply_pair_rotation`), alternating in one process on the same encoder
(Llama-4 Scout's tower, random bf16 weights, 8-32 images of 5 tiles), CUDA-event medians; the
features of both paths are compared.

    python benchmarks/vision_rope_ab.py --out benchmarks/results/vision_rope_ab_h200.json
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import benchmarks.vision_encoder_gpu_bench as vb  # noqa: E402
import models.llama4_vision as lv  # noqa: E402


def median_ms(fn, iters: int = 8) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    enc = vb.build_encoder(vb.SCOUT_VISION, "weights", torch.bfloat16, dev, 0)
    fused = lv.fused_kernels_serve
    rows = []
    with torch.inference_mode():
        for images in (8, 16, 32):
            px = vb.make_pixels(images * 5, 336, images, dev, torch.bfloat16)
            row = {"images": images, "triton_ms": [], "torch_ms": []}
            for _ in range(2):
                for name, serve in (("triton_ms", fused), ("torch_ms", lambda x: False)):
                    lv.fused_kernels_serve = serve
                    for _ in range(2):
                        enc(px)
                    row[name].append(median_ms(lambda: enc(px)))
            lv.fused_kernels_serve = fused
            a = enc(px)
            lv.fused_kernels_serve = lambda x: False
            b = enc(px)
            lv.fused_kernels_serve = fused
            row["max_abs_diff"] = float((a.float() - b.float()).abs().max())
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
