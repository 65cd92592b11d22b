"""Where one forward of Llama-4 Scout's vision tower goes on one GPU (40 tiles = 8 images of 5, bf16,
random weights): the top CUDA kernels under torch.profiler.

    python benchmarks/profile_vision_encoder.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import benchmarks.vision_encoder_gpu_bench as vb  # noqa: E402
from moe.distributed import ParallelLayout, init_parallel_state  # noqa: E402

init_parallel_state(ParallelLayout(tp=1), 0)
dev = torch.device("cuda")
enc = vb.build_encoder(vb.SCOUT_VISION, "weights", torch.bfloat16, dev, 0)
px = vb.make_pixels(40, 336, 0, dev, torch.bfloat16)
with torch.inference_mode():
    for _ in range(3):
        enc(px)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        enc(px)
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70))
