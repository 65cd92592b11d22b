"""The `moe` command: `moe generate`, `moe serve`, `moe bench NAME`, `moe tune-moe` and `moe dashboard`."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from moe.config import EngineArgs


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0 = all tokens")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--logprobs", type=int, default=None, help="log-probabilities of this many top tokens per step")


def _show_defaults(p: argparse.ArgumentParser) -> None:
    """ArgumentDefaultsHelpFormatter only annotates flags that have a help text: give the others one."""
    for action in p._actions:
        if action.help is None and action.default not in (None, argparse.SUPPRESS):
            action.help = "(default: %(default)s)"


def _parse_prompt_token_ids(values: list[str] | None) -> list[dict]:
    prompts = []
    for s in values or []:
        try:
            ids = json.loads(s)
        except json.JSONDecodeError:
            ids = None
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in ids):
            raise ValueError(f"--prompt-token-ids expects a non-empty JSON list of integers, e.g. '[1, 5, 9]'; "
                             f"got {s!r}")
        prompts.append({"prompt_token_ids": ids})
    return prompts


def _output_json(out, with_logprobs: bool) -> dict:
    outputs = []
    for o in out.outputs:
        d = {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
        if with_logprobs:
            d["cumulative_logprob"] = o.cumulative_logprob
            # one {token id: logprob} per generated token (JSON keys are strings)
            d["logprobs"] = None if o.logprobs is None else [
                {str(t): lp.logprob for t, lp in step.items()} for step in o.logprobs]
        outputs.append(d)
    return {"prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids, "outputs": outputs}


def _generate(args: argparse.Namespace) -> int:
    # Everything the user typed is checked before the model loads (which can take minutes).
    from moe.sampling_params import SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, seed=args.sampling_seed, max_tokens=args.max_tokens,
                            stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    prompts = list(args.prompts) + _parse_prompt_token_ids(args.prompt_token_ids)
    if not prompts:
        raise ValueError("give at least one prompt (text arguments or --prompt-token-ids '[1, 5, 9]')")
    engine_args = EngineArgs.from_cli_args(args)

    from moe.entrypoints.llm import LLM

    llm = LLM(**vars(engine_args))
    try:
        for out in llm.generate(prompts, params, use_tqdm=not args.json):
            if args.json:
                print(json.dumps(_output_json(out, args.logprobs is not None)))
            else:
                for o in out.outputs:
                    print(f"Prompt: {out.prompt!r}\nGenerated: {o.text!r}  [{len(o.token_ids)} tokens, "
                          f"{o.finish_reason}]")
    finally:
        llm.shutdown()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from moe.entrypoints.serve.api_server import run_server

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model or args.model_tag
    if args.model is None:
        raise ValueError("give the model: moe serve MODEL [engine arguments]")
    return run_server(args, EngineArgs.from_cli_args(args))


def _dashboard(args: argparse.Namespace) -> int:
    import uvicorn

    from moe.dashboard import build_dashboard_app

    app = build_dashboard_app(args.recording)  # FileNotFoundError / ValueError: reported by main()
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"moe dashboard: {args.recording} at http://{host}:{args.port}/dashboard/", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


# `moe bench NAME` -> (module whose main(argv) it runs, one line for `moe bench --help`).
BENCHMARKS = {
    "throughput": ("moe.bench.throughput", "offline throughput of LLM.generate (vLLM's flags; CPU-sized defaults)"),
    "latency": ("moe.bench.latency", "latency of one batch, average and percentiles (vLLM's flags)"),
    "scheduler": ("moe.bench.scheduler", "the scheduler alone, per step (CPU)"),
    "kernel": ("moe.bench.kernel", "the expert kernel against references and vLLM's kernel (needs a CUDA GPU)"),
    "all2all": ("moe.bench.all2all", "token dispatch + combine (run under torchrun: torchrun --nproc-per-node=N "
                                     "-m moe.bench.all2all)"),
    "serve": ("moe.bench.serve", "online serving against a running server (vLLM's bench serve flags: "
                                 "--num-prompts, --request-rate, --max-concurrency, ...)"),
    "engine-cpu": ("moe.bench.engine_cpu", "engine overhead per step beside the model forward (CPU)"),
}


def _run_module_main(module: str, argv: list[str]) -> int:
    import importlib

    return int(importlib.import_module(module).main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe", description="moe-runtime: Mixture-of-Experts inference")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate text for prompts given on the command line",
                         description="Generate text for prompts given on the command line.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompts", nargs="*", help="text prompts")
    gen.add_argument("--prompt-token-ids", action="append", default=None,
                     help="a JSON list of token ids, e.g. '[1, 5, 9]' (repeatable)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per prompt (with logprobs when --logprobs is given)")
    EngineArgs.add_cli_args(gen)
    _add_sampling_args(gen)
    _show_defaults(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: moe serve MODEL [engine arguments]",
                           description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                                       "/v1/chat/completions, /v1/models, /health, /version, /metrics).",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from moe.entrypoints.serve.api_server import add_serve_args

    add_serve_args(serve)
    EngineArgs.add_cli_args(serve, model_required=False)
    _show_defaults(serve)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="run a benchmark: moe bench NAME [its flags] (moe bench NAME --help)",
                           description="Run a benchmark; its own flags follow its name "
                                       "(moe bench NAME --help lists them).")
    names = bench.add_subparsers(dest="bench_name", required=True, metavar="NAME")
    for name, (module, summary) in BENCHMARKS.items():
        # add_help=False: --help and every flag go to the benchmark's own parser (prog "moe bench NAME")
        b = names.add_parser(name, help=summary, add_help=False)
        b.set_defaults(func=lambda a, module=module: _run_module_main(module, a.rest))
    tune = sub.add_parser("tune-moe", add_help=False,
                          help="tune the Triton expert kernel on this GPU and write a config file (needs a CUDA GPU)")
    tune.set_defaults(func=lambda a: _run_module_main("kernels.triton_moe.tune", a.rest))

    dash = sub.add_parser("dashboard", help="a web dashboard of an expert-load recording: moe dashboard RECORDING",
                          description="Serve a web page that shows an expert-load recording (JSON lines); "
                                      "a recording still being written updates live.",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    dash.add_argument("recording", help="the expert-load recording file (.jsonl)")
    dash.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback: this machine only)")
    dash.add_argument("--port", type=int, default=8050, help="port to listen on")
    dash.set_defaults(func=_dashboard)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    args, rest = build_parser().parse_known_args(argv)
    if args.func in (_generate, _serve, _dashboard) and rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        return args.func(args)
    except (ValueError, OSError, NotImplementedError) as e:
        print(f"moe {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
