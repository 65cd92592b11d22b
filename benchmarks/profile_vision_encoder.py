"""Where one forward of Llama-4 Scout's vision tower goes on one GPU (40 tiles = 8 images of 5, bf16,
random weights): the top kernels under torch.profiler. Without a GPU it profiles the tiny tower on the
CPU (a check that the script runs).

    python benchmarks/profile_vision_encoder.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import benchmarks.vision_encoder_gpu_bench as vb  # noqa: E402

CUDA = torch.cuda.is_available()
dev = torch.device("cuda" if CUDA else "cpu")
vision = vb.SCOUT_VISION if CUDA else vb.TINY_VISION
enc = vb.build_encoder(vision, "weights", torch.bfloat16, dev, 0)
px = vb.make_pixels(40, vision["image_size"], 0, dev, torch.bfloat16)
activity = torch.profiler.ProfilerActivity.CUDA if CUDA else torch.profiler.ProfilerActivity.CPU
with torch.inference_mode():
    for _ in range(3):
        enc(px)
    if CUDA:
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=[activity]) as prof:
        enc(px)
        if CUDA:
            torch.cuda.synchronize()
sort = "cuda_time_total" if CUDA else "cpu_time_total"
print(prof.key_averages().table(sort_by=sort, row_limit=22, max_name_column_width=70))
