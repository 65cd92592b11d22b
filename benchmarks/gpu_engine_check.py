"""Engine checks and timings on one GPU, in one call:

1. the built-in tiny model generates the same greedy tokens on the GPU as on the CPU
   (fp32; with the torch and the Triton expert backends);
2. KV-cache sizing from a profiled forward (block counts at two memory utilisations);
3. a Qwen3-30B-A3B-shaped model with dummy bf16 weights: decode-step time at 256 running
   requests against the floor (every weight read once + KV read, at 4.8 TB/s).

    python benchmarks/gpu_engine_check.py --out results.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch

from moe.bench.common import QWEN3_30B_A3B
from benchmarks.gpu_models_check import compare_gpu_to_cpu
from moe import LLM, SamplingParams



def parity(results: dict) -> None:
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(n)]} for n in (1, 7, 16, 33, 100, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for backend, r in compare_gpu_to_cpu("tiny-qwen3-moe", prompts, params).items():
        results[f"tiny_parity_{backend}"] = r
        print(f"tiny model, GPU ({backend} experts) vs CPU greedy: {r['identical']}/{r['of']} sequences identical")


def kv_sizing(results: dict) -> None:
    for util in (0.9, 0.5):
        llm = LLM("tiny-qwen3-moe", device="cuda", dtype="bfloat16", gpu_memory_utilization=util)
        blocks = llm.llm_engine.scheduler.kv.num_blocks
        results[f"tiny_kv_blocks_util_{util}"] = blocks
        print(f"gpu_memory_utilization={util}: {blocks} KV blocks")
        del llm
        torch.cuda.empty_cache()


def big_decode(results: dict, num_requests: int, prompt_len: int, out_len: int) -> None:
    path = tempfile.mkdtemp()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(QWEN3_30B_A3B, f)
    t0 = time.perf_counter()
    llm = LLM(path, device="cuda", load_format="dummy", max_model_len=1024, max_num_seqs=num_requests,
              enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 150000) for _ in range(prompt_len)]} for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    step_times = []
    while engine.has_unfinished_requests():
        torch.cuda.synchronize()
        t = time.perf_counter()
        so_decode = all(r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running) \
            and not engine.scheduler.waiting
        engine.step()
        torch.cuda.synchronize()
        if so_decode:
            step_times.append(time.perf_counter() - t)
    step_times.sort()
    median = step_times[len(step_times) // 2]
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.executor.model.parameters())
    ctx = prompt_len + out_len // 2
    kv_bytes = num_requests * ctx * 48 * 2 * 4 * 128 * 2
    floor = (weight_bytes + kv_bytes) / 4.8e12
    results["qwen3_30b_a3b_decode"] = {
        "num_requests": num_requests, "prompt_len": prompt_len, "decode_steps_timed": len(step_times),
        "median_step_ms": median * 1e3, "floor_ms": floor * 1e3, "time_over_floor": median / floor,
        "weight_gb": weight_bytes / 1e9, "load_s": load_s, "kv_blocks": engine.scheduler.kv.num_blocks}
    print(f"Qwen3-30B-A3B shape, {num_requests} running, decode step median {median * 1e3:.1f} ms, "
          f"floor {floor * 1e3:.1f} ms ({median / floor:.1f}x), weights {weight_bytes / 1e9:.1f} GB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-big", action="store_true")
    parser.add_argument("--num-requests", type=int, default=256)
    args = parser.parse_args(argv)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    parity(results)
    kv_sizing(results)
    if not args.skip_big:
        big_decode(results, args.num_requests, prompt_len=128, out_len=16)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
