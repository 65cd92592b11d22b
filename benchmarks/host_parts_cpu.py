"""Host time of each part of an engine step on the CPU: gpu_engine_bench.py's host_parts (the
`host256` run of the GPU stage) on the built-in tiny model, float32, 256 running requests of
64-token prompts, then mixed steps of 255 decodes beside a new 128-token prompt. The model's own
forward is in `launch` and `logits_launch` here (the CPU computes it); the other parts are the
host work a GPU step also does. Median of `--repeats` runs, each part in ms a step.

    python benchmarks/host_parts_cpu.py --out benchmarks/results/host_parts_cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import gpu_engine_bench as bench

    from moe import LLM

    prompts = bench._prompts
    bench._prompts = lambda n, length, seed=0, vocab=0: prompts(n, length, seed, vocab=500)  # the tiny vocabulary
    llm = LLM("tiny-qwen3-moe", dtype="float32", device="cpu", enable_prefix_caching=False, max_num_seqs=256)
    runs = [bench.host_parts(llm, num_decodes=256, chunk=128, prompt_len=64) for _ in range(args.repeats)]
    out = {"command": f"python benchmarks/host_parts_cpu.py --repeats {args.repeats}", "runs": runs, "median": {}}
    for kind in ("decode", "mixed"):
        parts = [k for k, v in runs[0][kind].items() if isinstance(v, float)]
        out["median"][kind] = {k: round(statistics.median(r[kind][k] for r in runs), 4) for k in parts}
    print(json.dumps(out["median"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
