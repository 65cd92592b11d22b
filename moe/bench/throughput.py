"""Offline throughput as vLLM's `vllm bench throughput` measures it: `--num-prompts` prompts of
`--input-len` random token ids, each generating exactly `--output-len` tokens (ignore_eos,
temperature 1.0), all submitted to one `LLM.generate`; the time is that call's.

Defaults are sized for the CPU and the built-in tiny model (a few seconds). The CPU workload of
BENCHMARKS.md's engine section is `--num-prompts 64 --input-len 128 --output-len 64 --dtype
float32 --no-enable-prefix-caching`; on a GPU, e.g. `--model CKPT --load-format dummy
--num-prompts 1000 --input-len 1024 --output-len 256`.
"""
from __future__ import annotations

import argparse
import sys
import time

from moe.bench.engine_workload import (add_engine_args, engine_kwargs_from_args, environment, random_prompts,
                                       write_json)


def run_throughput(engine_kwargs: dict, input_len: int, output_len: int, num_prompts: int, seed: int = 0,
                   use_tqdm: bool = False) -> dict:
    """Build an LLM from `engine_kwargs` (with "model"), run the workload once, return vLLM's
    throughput fields plus token counts and where it ran."""
    from moe import LLM, SamplingParams

    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    kwargs = dict(engine_kwargs)
    llm = LLM(kwargs.pop("model"), **kwargs)
    try:
        prompts = random_prompts(num_prompts, input_len, llm.llm_engine.model_config.vocab_size, seed)
        params = SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    return {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": total,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "workload": {"input_len": input_len, "output_len": output_len, "num_prompts": num_prompts, "seed": seed,
                     "dataset_name": "random"},
        "engine_kwargs": engine_kwargs,
        **environment(engine_kwargs),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe bench throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset-name", choices=["random"], default="random",
                   help="random: uniform random token ids (the only dataset)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=16, help="generated tokens per request (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=16, help="requests (default: %(default)s)")
    p.add_argument("--output-json", default=None, help="write the result as JSON here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    r = run_throughput(engine_kwargs_from_args(args), args.input_len, args.output_len, args.num_prompts,
                       seed=args.seed, use_tqdm=not args.disable_tqdm)
    print(f"Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total tokens/s, "
          f"{r['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {r['total_prompt_tokens']}\nTotal num output tokens:  {r['total_output_tokens']}")
    if args.output_json:
        write_json(args.output_json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
