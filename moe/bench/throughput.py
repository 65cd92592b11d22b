"""Offline throughput as vLLM's `vllm bench throughput` measures it: `--num-prompts` prompts of
`--input-len` random token ids, each generating exactly `--output-len` tokens (ignore_eos,
temperature 1.0), all submitted to one `LLM.generate`; the time is that call's.

`--random-range-ratio R` (vLLM's flag, in [0, 1)) draws each request's input and output length
uniformly in [len * (1 - R), len * (1 + R)] (at least 1) with a random.Random(--seed), as
`moe bench serve` draws them (moe.bench.serve.sample_lengths); R = 0 (the default): every
request exactly --input-len and --output-len. `--random-prefix-len P`: every prompt begins with the
same P random tokens (prefix caching reuses them), then its own. The result counts the tokens
actually used.

`--dataset-name sharegpt --dataset-path FILE`: recorded conversations instead (vLLM's ShareGPT
rules, moe/bench/datasets.py): each request the first turn of one, as text, generating its answer's
token count (`--output-len` fixes that instead); --input-len and --random-range-ratio do not apply.

Defaults are sized for the CPU and the built-in tiny model (a few seconds). The CPU workload of
BENCHMARKS.md §6 is `--num-prompts 64 --input-len 128 --output-len 64 --dtype
float32 --no-enable-prefix-caching`; on a GPU, e.g. `--model CKPT --load-format dummy
--num-prompts 1000 --input-len 1024 --output-len 256` (mixed lengths: `--random-range-ratio 0.75`).
"""
from __future__ import annotations

import argparse
import sys
import time

from moe.bench.engine_workload import (add_engine_args, engine_kwargs_from_args, environment, random_token_requests,
                                       write_json)
from moe.bench.datasets import DATASETS, check_dataset_args, load_sharegpt, sharegpt_requests
from moe.bench.serve import check_range_ratio

DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 32, 16  # the random dataset's, sized for the CPU and the tiny model


def run_throughput(engine_kwargs: dict, input_len: int | None, output_len: int | None, num_prompts: int,
                   seed: int = 0, use_tqdm: bool = False, range_ratio: float = 0.0, dataset_name: str = "random",
                   dataset_path: str | None = None, oversample: bool = True, prefix_len: int = 0) -> dict:
    """Build an LLM from `engine_kwargs` (with "model"), run the workload once, return vLLM's
    throughput fields plus token counts, the per-request lengths asked for and where it ran.
    The random dataset needs input_len and output_len; sharegpt reads dataset_path (output_len,
    when given, fixes every request's output length). prefix_len: random tokens that begin every
    prompt of the random dataset (its input_len more follow)."""
    from moe import LLM, SamplingParams

    check_dataset_args(dataset_name, dataset_path)  # before the engine starts
    if prefix_len < 0 or (prefix_len and dataset_name != "random"):
        raise ValueError(f"--random-prefix-len must be >= 0, and is for the random dataset only, got {prefix_len}")
    if dataset_name == "random" and (input_len is None or output_len is None):
        raise ValueError("the random dataset needs input_len and output_len")
    if output_len is not None and output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    check_range_ratio(range_ratio)
    pairs = load_sharegpt(dataset_path) if dataset_name == "sharegpt" else None  # a bad file: before the engine
    kwargs = dict(engine_kwargs)
    llm = LLM(kwargs.pop("model"), **kwargs)
    try:
        if dataset_name == "random":
            requests = random_token_requests(num_prompts, input_len, output_len,
                                             llm.llm_engine.model_config.vocab_size, seed, range_ratio, prefix_len)
        else:
            tokenizer = llm.get_tokenizer()
            if tokenizer is None:
                raise ValueError(f"--dataset-name {dataset_name} needs the model's tokenizer (tokenizer.json) to "
                                 "count the prompts' tokens")
            requests = [(r.prompt, r.output_len) for r in sharegpt_requests(
                dataset_path, num_prompts, tokenizer, seed, output_len, oversample, pairs)]
        params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n_out)
                  for _, n_out in requests]
        start = time.perf_counter()
        outputs = llm.generate([p for p, _ in requests], params, use_tqdm=use_tqdm)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    input_lens = [len(o.prompt_token_ids) for o in outputs]
    output_lens = [n for _, n in requests]
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
                     "dataset_name": dataset_name, "dataset_path": dataset_path, "random_range_ratio": range_ratio,
                     "random_prefix_len": prefix_len,
                     "input_lens": input_lens, "output_lens": output_lens},
        "engine_kwargs": engine_kwargs,
        **environment(engine_kwargs),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe bench throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset-name", choices=DATASETS, default="random",
                   help="random: uniform random token ids; sharegpt: a ShareGPT file's conversations (--dataset-path)")
    p.add_argument("--dataset-path", default=None, help="the dataset's file (sharegpt: a ShareGPT JSON file)")
    p.add_argument("--no-oversample", action="store_true",
                   help="sharegpt: run only the conversations that pass, when fewer than --num-prompts")
    p.add_argument("--input-len", type=int, default=None,
                   help=f"prompt tokens per request (random; default: {DEFAULT_INPUT_LEN})")
    p.add_argument("--output-len", type=int, default=None,
                   help=f"generated tokens per request (random; default: {DEFAULT_OUTPUT_LEN}; sharegpt: "
                        "each answer's length unless given)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="per-request lengths drawn uniformly in [len * (1 - r), len * (1 + r)], r in [0, 1) "
                        "(default: %(default)s: every request exactly --input-len / --output-len)")
    p.add_argument("--random-prefix-len", "--prefix-len", type=int, default=0,
                   help="random: tokens of one random prefix that begins every prompt, before its --input-len own "
                        "(prefix caching reuses it; default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=16, help="requests (default: %(default)s)")
    p.add_argument("--output-json", default=None, help="write the result as JSON here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_range_ratio(args.random_range_ratio)
        check_dataset_args(args.dataset_name, args.dataset_path)
    except ValueError as e:
        parser.error(str(e))
    if args.dataset_name == "random":
        args.input_len = DEFAULT_INPUT_LEN if args.input_len is None else args.input_len
        args.output_len = DEFAULT_OUTPUT_LEN if args.output_len is None else args.output_len
    r = run_throughput(engine_kwargs_from_args(args), args.input_len, args.output_len, args.num_prompts,
                       seed=args.seed, use_tqdm=not args.disable_tqdm, range_ratio=args.random_range_ratio,
                       dataset_name=args.dataset_name, dataset_path=args.dataset_path,
                       oversample=not args.no_oversample, prefix_len=args.random_prefix_len)
    print(f"Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total tokens/s, "
          f"{r['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {r['total_prompt_tokens']}\nTotal num output tokens:  {r['total_output_tokens']}")
    if args.output_json:
        write_json(args.output_json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
