"""End-to-end CPU throughput with the engine overhead split out (`moe bench engine-cpu`): the
built-in tiny model, 64 prompts x 128 random token ids, 64 greedy output tokens each, float32,
no prefix caching, best of 3 `generate` calls; reports the engine overhead per step (everything
outside the model forward). `moe bench throughput` is the vLLM-compatible measure.

    moe bench engine-cpu [--out benchmarks/results/engine_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import time

import torch

from moe import LLM, SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe bench engine-cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen3-moe",
                        help="checkpoint folder, or 'tiny-qwen3-moe', the built-in model (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per run (default: %(default)s)")
    parser.add_argument("--input-len", type=int, default=128,
                        help="random prompt tokens per request (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=64,
                        help="greedy tokens generated per request (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed generate calls; the best one is reported (default: %(default)s)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    llm = LLM(args.model, dtype="float32", device="cpu", enable_prefix_caching=False)
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up

    # Time the model forward separately to split engine overhead from model time.
    runner = llm.llm_engine.executor.runner
    forward = runner.model.forward
    forward_time = [0.0]

    def timed_forward(*a, **kw):
        t0 = time.perf_counter()
        out = forward(*a, **kw)
        forward_time[0] += time.perf_counter() - t0
        return out

    runner.model.forward = timed_forward
    runs, first_tokens = [], None
    for _ in range(args.repeats):
        forward_time[0] = 0.0
        steps_before = llm.llm_engine.num_steps
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        steps = llm.llm_engine.num_steps - steps_before
        tokens = [o.outputs[0].token_ids for o in outs]
        assert all(len(t) == args.output_len for t in tokens)
        if first_tokens is None:
            first_tokens = tokens
        assert tokens == first_tokens, "greedy outputs changed between runs"
        n_out = sum(len(t) for t in tokens)
        runs.append({"seconds": elapsed, "output_tok_per_s": n_out / elapsed, "steps": steps,
                     "forward_s": forward_time[0],
                     "overhead_ms_per_step": (elapsed - forward_time[0]) / steps * 1e3})
    best = max(runs, key=lambda r: r["output_tok_per_s"])
    result = {"model": args.model, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "cpu": platform.processor() or platform.machine(), "workload": vars(args), "runs": runs, "best": best}
    print(f"output tok/s (best of {args.repeats}): {best['output_tok_per_s']:.1f}  "
          f"[{best['seconds']:.2f} s, {best['steps']} steps, forward {best['forward_s']:.2f} s, "
          f"engine overhead {best['overhead_ms_per_step']:.2f} ms/step]")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
