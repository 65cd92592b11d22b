"""CPU benchmark of the scheduler alone: schedule() + update_from_output() per decode step
with N running requests, with and without prefix caching.

    moe bench scheduler [--out benchmarks/results/scheduler.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

from scheduler import Request, Scheduler, SchedulerConfig


def bench(num_running: int, caching: bool, steps: int = 200, prompt_len: int = 512, block_size: int = 16) -> dict:
    blocks_per_req = (prompt_len + steps + 64) // block_size + 1
    sched = Scheduler(SchedulerConfig(
        max_num_seqs=num_running, max_num_batched_tokens=max(8192, num_running), max_model_len=4096,
        block_size=block_size, num_blocks=num_running * blocks_per_req + 16,
        enable_prefix_caching=caching))
    rng = random.Random(0)
    for i in range(num_running):
        sched.add_request(Request(f"r{i}", [rng.randrange(1, 32000) for _ in range(prompt_len)], max_tokens=10**6))
    # Prefill everything first (not timed), then time steady-state decode steps.
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.requests.values()):
        so = sched.schedule()
        sched.update_from_output(so, {rid: [1] for rid in so.num_scheduled_tokens
                                      if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens})
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        so = sched.schedule()
        sampled = {rid: [step % 31000 + 1] for rid in so.num_scheduled_tokens}
        sched.update_from_output(so, sampled)
        times.append(time.perf_counter() - t0)
        assert len(so.num_scheduled_tokens) == num_running
    return {"num_running": num_running, "prefix_caching": caching, "steps": steps,
            "median_ms": statistics.median(times) * 1e3, "mean_ms": statistics.mean(times) * 1e3,
            "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe bench scheduler", description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--num-running", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=5,
                        help="fresh runs per row; the row reports the run with the median median")
    args = parser.parse_args(argv)
    rows = []
    for n in args.num_running:
        for caching in (False, True):
            runs = sorted((bench(n, caching, args.steps) for _ in range(args.repeats)), key=lambda r: r["median_ms"])
            rows.append({**runs[len(runs) // 2], "repeats": args.repeats,
                         "median_ms_of_each_run": [round(r["median_ms"], 4) for r in runs]})
    print(f"{'running':>8} {'prefix cache':>12} {'median ms':>10} {'mean ms':>8} {'p90 ms':>7}")
    for r in rows:
        print(f"{r['num_running']:>8} {str(r['prefix_caching']):>12} {r['median_ms']:>10.3f} {r['mean_ms']:>8.3f} "
              f"{r['p90_ms']:>7.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
