"""Latency of one batch as vLLM's `vllm bench latency` measures it: `--batch-size` prompts of
`--input-len` random token ids generating exactly `--output-len` tokens each (ignore_eos,
temperature 1.0), one `LLM.generate` of the whole batch per iteration, timed end to end;
`--num-iters-warmup` untimed iterations first. The same prompts run every iteration (as in
vLLM), so with prefix caching on, later iterations reuse the prompt's KV blocks; pass
`--no-enable-prefix-caching` to prefill every time.

Defaults are sized for the CPU and the built-in tiny model (a few seconds).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from moe.bench.engine_workload import (add_engine_args, engine_kwargs_from_args, environment, random_prompts,
                                       write_json)

PERCENTILES = (10, 25, 50, 75, 90, 99)


def run_latency(engine_kwargs: dict, batch_size: int, input_len: int, output_len: int, num_iters: int,
                num_iters_warmup: int, seed: int = 0, progress: bool = False) -> dict:
    """Build an LLM from `engine_kwargs` (with "model") and time `num_iters` generate calls of one
    batch; returns vLLM's latency fields (seconds) plus the workload and where it ran."""
    from tqdm.auto import tqdm

    from moe import LLM, SamplingParams

    if num_iters < 1 or num_iters_warmup < 0 or output_len < 1:
        raise ValueError(f"need num_iters >= 1, num_iters_warmup >= 0 and output_len >= 1, got {num_iters}, "
                         f"{num_iters_warmup} and {output_len}")
    kwargs = dict(engine_kwargs)
    llm = LLM(kwargs.pop("model"), **kwargs)
    try:
        prompts = random_prompts(batch_size, input_len, llm.llm_engine.model_config.vocab_size, seed)
        params = SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)
        for _ in tqdm(range(num_iters_warmup), desc="Warmup iterations", disable=not progress):
            llm.generate(prompts, params, use_tqdm=False)
        latencies, output_tokens = [], []
        for _ in tqdm(range(num_iters), desc="Profiling iterations", disable=not progress):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            latencies.append(time.perf_counter() - start)
            output_tokens.append(sum(len(c.token_ids) for o in outputs for c in o.outputs))
    finally:
        llm.shutdown()
    arr = np.array(latencies)
    return {
        "avg_latency": float(arr.mean()),
        "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(arr, p)) for p in PERCENTILES},
        "output_tokens_per_iter": output_tokens,
        "workload": {"batch_size": batch_size, "input_len": input_len, "output_len": output_len,
                     "num_iters": num_iters, "num_iters_warmup": num_iters_warmup, "seed": seed},
        "engine_kwargs": engine_kwargs,
        **environment(engine_kwargs),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe bench latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=4, help="prompts per batch (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=16, help="prompt tokens per request (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=8, help="generated tokens per request (default: %(default)s)")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations (default: %(default)s)")
    p.add_argument("--num-iters", type=int, default=3, help="timed iterations (default: %(default)s)")
    p.add_argument("--output-json", default=None, help="write the result as JSON here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    r = run_latency(engine_kwargs_from_args(args), args.batch_size, args.input_len, args.output_len,
                    args.num_iters, args.num_iters_warmup, seed=args.seed, progress=not args.disable_tqdm)
    print(f"Avg latency: {r['avg_latency']:.4f} seconds")
    for p, v in r["percentiles"].items():
        print(f"{p}% percentile latency: {v:.4f} seconds")
    if args.output_json:
        write_json(args.output_json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
