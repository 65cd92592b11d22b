"""Where a CPU decode step goes, on the workload of `moe bench engine-cpu` (the built-in
tiny-qwen3-moe, 64 prompts x 128 random ids, float32, no prefix caching): the median wall time of
the decode steps of 64 requests, and torch.profiler's table of 20 of them.

    python benchmarks/cpu_decode_profile.py > benchmarks/results/cpu_decode_profile.log
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import torch

    from moe import LLM, SamplingParams

    llm = LLM("tiny-qwen3-moe", dtype="float32", device="cpu", enable_prefix_caching=False)
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(64):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(512) for _ in range(128)]}, params)
    engine.step()  # the prefill
    times = []
    for _ in range(10):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; decode step of 64: median "
          f"{statistics.median(times) * 1e3:.2f} ms over {len(times)} steps")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            engine.step()
    print("20 decode steps under the profiler:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))


if __name__ == "__main__":
    main()
