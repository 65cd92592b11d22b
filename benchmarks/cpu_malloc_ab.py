"""A/B of the CPU path's malloc settings (moe/worker/cpu_memory.py): MOE_CPU_KEEP_FREED_MEMORY = 1 / 0,
alternating, a fresh process each, on the workload of `moe bench engine-cpu` (the built-in
tiny-qwen3-moe, 64 prompts x 128 random ids, float32, no prefix caching): the time of the step
that prefills all 64 prompts (8,192 tokens) and the median decode step of 64 requests.

    python benchmarks/cpu_malloc_ab.py --rounds 3 --out benchmarks/results/cpu_malloc_ab.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _side() -> dict:
    sys.path.insert(0, ROOT)
    from moe import LLM, SamplingParams

    llm = LLM("tiny-qwen3-moe", dtype="float32", device="cpu", enable_prefix_caching=False)
    engine = llm.llm_engine
    rng = random.Random(0)
    prompts = [[rng.randrange(engine.model_config.vocab_size) for _ in range(128)] for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prefill, decode = [], []
    for rep in range(4):  # the first is a warm-up
        for i, p in enumerate(prompts):
            engine.add_request(f"{rep}-{i}", {"prompt_token_ids": p}, params)
        steps = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        if rep:
            prefill.append(steps[0] * 1e3)
            decode.append(statistics.median(steps[2:]) * 1e3)
    return {"prefill_step_ms": prefill, "decode_step_ms": decode}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        print(json.dumps(_side()))
        return
    rows = []
    for r in range(args.rounds):
        for keep in ("1", "0"):
            env = dict(os.environ, MOE_CPU_KEEP_FREED_MEMORY=keep)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--side"], env=env, cwd=ROOT,
                                 check=True, capture_output=True, text=True).stdout
            row = {"round": r, "keep_freed_memory": keep == "1", "load": os.getloadavg()[0],
                   **json.loads(out.strip().splitlines()[-1])}
            rows.append(row)
            print(f"round {r} keep={keep}: prefill step {[round(x) for x in row['prefill_step_ms']]} ms, "
                  f"decode step {[round(x, 1) for x in row['decode_step_ms']]} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
