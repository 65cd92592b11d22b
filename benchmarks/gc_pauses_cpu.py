"""Python's garbage-collector pauses inside engine steps, with the start-up heap frozen out of the
collector (moe/gc_freeze.py, the default) and without (MOE_GC_FREEZE=0), each in a fresh process:
the built-in tiny model on the CPU, 256 requests decoding while a new 128-token prompt joins every
step (255 decodes beside a prefill), `--steps` steps. Reports the collector's passes (all, full
ones), their total and longest ms, and the step times' median / p99 / max.

    python benchmarks/gc_pauses_cpu.py --out benchmarks/results/gc_pauses_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def measure(steps: int) -> dict:
    import gc
    import statistics
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_engine_bench as bench

    from moe import LLM, SamplingParams

    llm = LLM("tiny-qwen3-moe", dtype="float32", device="cpu", enable_prefix_caching=False, max_num_seqs=256)
    engine = llm.llm_engine
    decoding = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for i, p in enumerate(bench._prompts(255, 64, seed=4, vocab=500)):  # the tiny model's vocabulary
        engine.add_request(f"decode-{i}", p, decoding)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()
    pauses, t0 = [], [0.0]

    def on_gc(phase, info):
        if phase == "start":
            t0[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - t0[0]))
    prompts = bench._prompts(steps, 128, seed=3, vocab=500)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    step_s = []
    gc.callbacks.append(on_gc)
    for i in range(steps):
        engine.add_request(f"join-{i}", prompts[i], one)
        t = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t)
    gc.callbacks.remove(on_gc)
    step_s.sort()
    return {"gc_freeze": os.environ.get("MOE_GC_FREEZE", "1") != "0", "steps": steps,
            "gc_passes": len(pauses), "gc_full_passes": sum(g == 2 for g, _ in pauses),
            "gc_total_ms": round(1e3 * sum(t for _, t in pauses), 3),
            "gc_max_ms": round(1e3 * max((t for _, t in pauses), default=0.0), 3),
            "step_ms_median": round(1e3 * statistics.median(step_s), 3),
            "step_ms_p99": round(1e3 * step_s[int(0.99 * (len(step_s) - 1))], 3),
            "step_ms_max": round(1e3 * step_s[-1], 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.steps)))
        return 0
    rows = []
    for freeze in ("1", "0", "1", "0"):
        done = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps)], check=True,
                              env={**os.environ, "MOE_GC_FREEZE": freeze}, capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python benchmarks/gc_pauses_cpu.py --steps %d" % args.steps, "runs": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
