"""The `moe` command: `moe generate`, `moe serve`, `moe bench NAME`, `moe tune-moe` and `moe dashboard`."""
from __future__ import annotations

import argparse
import functools
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
    positional = list(args.prompts)
    if args.model is None:  # `moe generate MODEL PROMPT...`: the first positional is the model
        args.model = positional.pop(0) if positional else None
    if args.model is None:
        raise ValueError("give the model: moe generate MODEL PROMPT... (or --model MODEL)")
    prompts = positional + _parse_prompt_token_ids(args.prompt_token_ids)
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

    args.model = _one_model(args.model_tag, args.model, "moe serve MODEL [engine arguments]")
    return run_server(args, EngineArgs.from_cli_args(args))


def _one_model(positional: str | None, flag: str | None, usage: str) -> str:
    """The model, given positionally (vLLM's `serve` style) or as --model (its style elsewhere)."""
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"two models given: {positional!r} and --model {flag!r}")
    if positional is None and flag is None:
        raise ValueError(f"give the model: {usage} (or --model MODEL)")
    return flag or positional


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


# The benchmarks whose parsers take --model: `moe bench NAME MODEL ...` means `--model MODEL`.
BENCHMARKS_WITH_MODEL = ("throughput", "latency", "serve", "engine-cpu")


def _model_flag_first(name: str, argv: list[str]) -> list[str]:
    """argv of `moe bench NAME`, a leading positional model turned into --model."""
    if name not in BENCHMARKS_WITH_MODEL or not argv or argv[0].startswith("-"):
        return argv
    # Else the benchmark's parser would take both, the last silently.
    given = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--model"]
    given += [a[len("--model="):] for a in argv if a.startswith("--model=")]
    _one_model(argv[0], given[0] if given else None, f"moe bench {name} MODEL [flags]")
    return ["--model", argv[0], *argv[1:]]


def _run_module_main(module: str, argv: list[str]) -> int:
    import importlib

    return int(importlib.import_module(module).main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    import moe

    parser = argparse.ArgumentParser(prog="moe", description="moe-runtime: Mixture-of-Experts inference",
                                     epilog="moe COMMAND --help: a command's flags; moe --help=all: every "
                                            "command's flags")
    parser.add_argument("--version", action="version", version=moe.__version__, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate text for prompts given on the command line",
                         description="Generate text for prompts given on the command line: "
                                     "moe generate MODEL PROMPT... or moe generate --model MODEL PROMPT...",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompts", nargs="*", metavar="[MODEL] PROMPT",
                     help="text prompts; without --model the first is the model")
    gen.add_argument("--prompt-token-ids", action="append", default=None,
                     help="a JSON list of token ids, e.g. '[1, 5, 9]' (repeatable)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per prompt (with logprobs when --logprobs is given)")
    EngineArgs.add_cli_args(gen, model_required=False)
    _add_sampling_args(gen)
    gen.set_defaults(func=_generate)

    from moe.entrypoints.serve.api_server import add_serve_args
    from moe.entrypoints.serve.protocol import DEFAULT_MAX_N

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: moe serve MODEL [engine arguments]",
                           description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                                       "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /ping, "
                                       "/version, /metrics): moe serve MODEL or moe serve --model MODEL.",
                           epilog="environment: MOE_MAX_N_SEQUENCES, else VLLM_MAX_N_SEQUENCES: the most samples "
                                  f"(n) one request may ask for (default: {DEFAULT_MAX_N}); MOE_API_KEY, else "
                                  "VLLM_API_KEY: the API key when --api-key is not given",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(serve)
    EngineArgs.add_cli_args(serve, model_required=False)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="run a benchmark: moe bench NAME [its flags] (moe bench NAME --help)",
                           description="Run a benchmark; its own flags follow its name "
                                       "(moe bench NAME --help lists them).")
    names = bench.add_subparsers(dest="bench_name", required=True, metavar="NAME")
    for name, (module, summary) in BENCHMARKS.items():
        # add_help=False: --help and every flag go to the benchmark's own parser (prog "moe bench NAME")
        b = names.add_parser(name, help=summary, add_help=False)
        b.set_defaults(func=lambda a, module=module, name=name: _run_module_main(module,
                                                                                 _model_flag_first(name, a.rest)))
    tune = sub.add_parser("tune-moe", add_help=False,
                          help="tune the Triton expert kernel on this GPU and write a config file (needs a CUDA GPU)")
    tune.set_defaults(func=lambda a: _run_module_main(TUNE_MODULE, a.rest))

    dash = sub.add_parser("dashboard", help="a web dashboard of an expert-load recording: moe dashboard RECORDING",
                          description="Serve a web page that shows an expert-load recording (JSON lines); "
                                      "a recording still being written updates live.",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    dash.add_argument("recording", help="the expert-load recording file (.jsonl)")
    dash.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback: this machine only)")
    dash.add_argument("--port", type=int, default=8050, help="port to listen on")
    dash.set_defaults(func=_dashboard)
    return parser


TUNE_MODULE = "kernels.triton_moe.tune"


def _module_help(module: str) -> str:
    """The --help text of a command whose parser lives in its module (moe bench NAME, moe tune-moe)."""
    import contextlib
    import io

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            _run_module_main(module, ["--help"])
    except SystemExit:
        pass
    except Exception as e:  # e.g. a GPU-only module on a machine without Triton
        return f"(its help needs {module}, which does not load here: {type(e).__name__}: {e})\n"
    return out.getvalue()


def print_all_help(argv: list[str]) -> None:
    """`--help=all` (vLLM accepts it): the full help of the command that argv names, else of every
    command. Each parser here has one group of flags, so `all` is its plain --help."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    helps = {}  # "generate", "serve", "bench throughput", ...: a function that returns its help text
    for name, sub in commands.items():
        if name == "bench":
            helps.update({f"bench {n}": functools.partial(_module_help, m) for n, (m, _) in BENCHMARKS.items()})
        elif name == "tune-moe":
            helps[name] = functools.partial(_module_help, TUNE_MODULE)
        else:
            helps[name] = sub.format_help
    words = [a for a in argv if not a.startswith("-")]
    chosen = []
    for key in (" ".join(words[:2]), " ".join(words[:1])) if words else ():
        chosen = chosen or [n for n in helps if n == key or n.startswith(key + " ")]
    if not chosen:
        print(parser.format_help())
        chosen = list(helps)
    for name in chosen:
        print(f"===== moe {name} =====\n{helps[name]()}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help=all" in argv:
        print_all_help(argv[:argv.index("--help=all")])
        return 0
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
