"""The `moe` command: `moe generate` now; serving, benchmarks and the kernel tuner join it as
subcommands."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from moe.config import EngineArgs


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--logprobs", type=int, default=None)


def _generate(args: argparse.Namespace) -> int:
    from moe import LLM, SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, seed=args.sampling_seed, max_tokens=args.max_tokens,
                            stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    prompts = list(args.prompts)
    if args.prompt_token_ids:
        prompts += [{"prompt_token_ids": json.loads(s)} for s in args.prompt_token_ids]
    if not prompts:
        print("moe generate: give at least one prompt", file=sys.stderr)
        return 2
    for out in llm.generate(prompts, params, use_tqdm=not args.json):
        if args.json:
            print(json.dumps({"prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
                              "outputs": [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                                          for o in out.outputs]}))
        else:
            for o in out.outputs:
                print(f"Prompt: {out.prompt!r}\nGenerated: {o.text!r}  [{len(o.token_ids)} tokens, {o.finish_reason}]")
    return 0


# `moe bench NAME` -> the benchmark module whose main(argv) it runs.
BENCHMARKS = {
    "kernel": "benchmarks.bench_kernel",         # expert layer vs references (GPU)
    "all2all": "benchmarks.bench_all2all",       # token dispatch (under torchrun)
    "scheduler": "benchmarks.bench_scheduler",   # scheduler alone (CPU)
    "throughput": "benchmarks.bench_engine_cpu",  # end-to-end generate (CPU workload of TARGETS §3)
}


def _run_module_main(module: str, argv: list[str]) -> int:
    import importlib

    return int(importlib.import_module(module).main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe", description="moe-runtime: Mixture-of-Experts inference")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts given on the command line")
    gen.add_argument("prompts", nargs="*", help="text prompts")
    gen.add_argument("--prompt-token-ids", action="append", default=None,
                     help="a JSON list of token ids, e.g. '[1, 5, 9]' (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    EngineArgs.add_cli_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="run a benchmark (its own flags follow the name; see --help)",
                           add_help=False)
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.set_defaults(func=lambda a: _run_module_main(BENCHMARKS[a.name], a.rest))
    tune = sub.add_parser("tune-moe", help="tune the Triton expert kernel on this GPU and write a config file",
                          add_help=False)
    tune.set_defaults(func=lambda a: _run_module_main("kernels.triton_moe.tune", a.rest))
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    args, rest = build_parser().parse_known_args(argv)
    if args.command == "generate" and rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        return args.func(args)
    except (ValueError, OSError, NotImplementedError) as e:
        print(f"moe {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
