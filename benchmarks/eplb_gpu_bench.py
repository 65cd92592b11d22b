"""EPLB on two GPUs: expert balance and decode-step time before and after one rebalance, on a
skewed workload, with data_parallel_size=2 + enable_expert_parallel (one GPU per DP rank).

    python benchmarks/eplb_gpu_bench.py --out gpu_out/eplb.json                     # two H200s
    python benchmarks/eplb_gpu_bench.py --tiny --device cpu --out /tmp/eplb.json    # a CPU check

Model: the Qwen3-30B-A3B shape (moe/bench/common.py) with dummy bf16 weights, from a config-only
folder made here (or --checkpoint: a config-only folder runs with dummy weights, a folder with
safetensors with its own); --tiny runs the built-in tiny model instead.

Workload (the skew): dummy weights route random tokens of the whole vocabulary almost uniformly,
so nothing would be left to balance. The prompts are therefore drawn from only --distinct-tokens
token ids (a seeded random subset of the vocabulary), each position independently with Zipf
weights 1 / rank^--zipf-exponent (64 ids at 1.2: the top id is ~29% of the tokens, the top 8 ~68%;
the JSON's "skew"). Few distinct hidden states reach the routers, so a few experts per layer get most of the tokens.
The decode tokens are whatever the model generates (greedy); their balance is reported apart.

Cases, each its own LLM: for each --redundant R, enable_eplb with num_redundant_experts=R and a
step_interval no run reaches (no automatic rebalance): a warm-up pass of the workload, the
workload "before" (balancedness, median decode-step time), `core.rebalance_experts()` on exactly
the before run's steps (its weight move timed by the engine: core.eplb.last_seconds), the
workload "after". Then a baseline without EPLB (step time and balance of the static placement).
Greedy tokens after the rebalance must equal those before (and the warm-up's: a check that the
run is deterministic at all); a mismatch fails the run (exit 1) and is in the JSON.

A decode step: one engine.step() while every request runs and has only its next token to
compute (no prefill in the step); the median over those steps, like gpu_engine_bench's decode_step.
Balancedness: mean / max of the rows each EP rank processed, per MoE layer ("mean" over layers and
"min"); "all" covers the whole workload (prefill dominates), "decode" only its decode steps;
"predicted_after" is what the new placement gives on the before run's counts (even replica split).

Writes --out after every case (a killed run keeps what finished); stops starting cases when
--deadline-s would be passed (a case is skipped when it would not fit, judged by the slowest
case so far).
Legend: L MoE layers, E logical experts, G expert-parallel ranks.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: this checkout's packages, not an installed copy
    sys.path.insert(0, ROOT)

from moe import LLM, SamplingParams  # noqa: E402
from moe.bench.common import QWEN3_30B_A3B  # noqa: E402
from moe.expert_load.recording import balancedness_of  # noqa: E402

NO_AUTOMATIC_REBALANCE = 10**9


# ---- the workload -------------------------------------------------------------------------
def zipf_token_ids(vocab: int, distinct: int, exponent: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """[distinct] token ids (a seeded subset of 1..vocab-1) and their Zipf probabilities."""
    if not 1 <= distinct < vocab:
        raise ValueError(f"--distinct-tokens must be in [1, vocab_size={vocab}), got {distinct}")
    if exponent < 0:
        raise ValueError(f"--zipf-exponent must be >= 0, got {exponent}")
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.arange(1, vocab), size=distinct, replace=False)
    weights = 1.0 / np.arange(1, distinct + 1, dtype=np.float64) ** exponent
    return ids, weights / weights.sum()


def skewed_prompts(num: int, length: int, vocab: int, distinct: int, exponent: float, seed: int) -> list[dict]:
    ids, probs = zipf_token_ids(vocab, distinct, exponent, seed)
    tokens_NT = np.random.default_rng(seed + 1).choice(ids, size=(num, length), p=probs)
    return [{"prompt_token_ids": row.tolist()} for row in tokens_NT]


# ---- one pass of the workload -------------------------------------------------------------
def _decode_only(engine, num_requests: int) -> bool:
    """Every request is running and has only its next token to compute."""
    running = 0
    for s in engine.schedulers:
        if s.waiting or any(r.num_computed_tokens != r.num_tokens - 1 for r in s.running):
            return False
        running += len(s.running)
    return running == num_requests


def _balance(per_rank_LG: np.ndarray) -> dict:
    b_L = balancedness_of(per_rank_LG)
    return {"mean": float(b_L.mean()), "min": float(b_L.min()), "per_layer": [round(float(x), 4) for x in b_L],
            "rows_per_rank": per_rank_LG.sum(axis=0).tolist()}


def _expert_skew(counts_LE: np.ndarray) -> float:
    """Mean over layers of the busiest expert's tokens over the mean expert's: the routing's own
    skew, whatever the placement (1.0 is uniform)."""
    mean_L = np.maximum(counts_LE.mean(axis=1), 1e-9)
    return float((counts_LE.max(axis=1) / mean_L).mean())


def run_workload(llm: LLM, prompts: list[dict], decode_steps: int, tag: str) -> tuple[dict, dict, np.ndarray]:
    """(numbers, greedy tokens by prompt index, logical counts [L, E]) of one pass, from a fresh
    expert-load baseline; steps are timed on the host (a step returns once its tokens are back)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps, ignore_eos=True)
    llm.reset_expert_load()
    first_step = engine.num_steps
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    times, tokens, at_decode, prefill_s = [], {}, None, 0.0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        decode_only = _decode_only(engine, len(prompts))
        if decode_only and at_decode is None:
            prefill_s = time.perf_counter() - start
            at_decode = llm.get_expert_load()  # the load of the prefill steps (and the first token)
        t = time.perf_counter()
        finished = engine.step()
        if decode_only:
            times.append(time.perf_counter() - t)
        for out in finished:
            tokens[int(out.request_id.rsplit("-", 1)[1])] = list(out.outputs[0].token_ids)
    load = llm.get_expert_load()
    if not times:
        raise RuntimeError(f"no step ran all {len(prompts)} requests decode-only: raise --decode-steps or "
                           "--max-num-seqs")
    times.sort()
    result = {"steps": engine.num_steps - first_step, "decode_steps_timed": len(times),
              "median_step_ms": 1e3 * times[len(times) // 2], "min_step_ms": 1e3 * times[0],
              "max_step_ms": 1e3 * times[-1], "prefill_s": prefill_s, "total_s": time.perf_counter() - start,
              "tokens_routed": load.total_tokens, "expert_max_over_mean": _expert_skew(load.counts),
              "balancedness": _balance(load.per_rank),
              "balancedness_decode": _balance(load.per_rank - at_decode.per_rank)}
    return result, tokens, load.counts


def compare_tokens(a: dict, b: dict) -> dict:
    """How many prompts got the same greedy tokens, and where the others first differ."""
    keys = sorted(set(a) | set(b))
    first_diff = {}
    for k in keys:
        x, y = a.get(k), b.get(k)
        if x != y:
            first_diff[str(k)] = None if x is None or y is None else \
                next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    return {"identical": len(keys) - len(first_diff), "of": len(keys), "first_divergence": first_diff}


# ---- the cases ----------------------------------------------------------------------------
def _engine_kwargs(args: argparse.Namespace, model: str) -> dict:
    dp = args.data_parallel_size
    from moe.engine.model_info import resolve_model_path

    path = resolve_model_path(model)  # a config-only folder has no weights: dummy ones
    has_weights = os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path))
    kw = dict(device=args.device, data_parallel_size=dp, enable_expert_parallel=True,
              max_model_len=args.prompt_len + args.decode_steps + 1,
              max_num_seqs=args.max_num_seqs or math.ceil(args.num_requests / dp),
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              enforce_eager=args.enforce_eager, load_format="auto" if has_weights else "dummy")
    if args.device == "cpu":
        kw["dtype"] = "float32"
    else:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    return kw


def eplb_case(args: argparse.Namespace, model: str, prompts: list[dict], redundant: int) -> tuple[dict, dict]:
    from routing.eplb import balancedness, gpu_loads

    t0 = time.perf_counter()
    llm = LLM(model, enable_eplb=True, **_engine_kwargs(args, model), eplb_config={
        "window_size": NO_AUTOMATIC_REBALANCE, "step_interval": NO_AUTOMATIC_REBALANCE,
        "num_redundant_experts": redundant})
    try:
        res = {"redundant": redundant, "start_s": time.perf_counter() - t0}
        core = llm.llm_engine.core
        warm_tokens = run_workload(llm, prompts, args.decode_steps, "warm")[1] if args.warmup else None
        before, before_tokens, counts_LE = run_workload(llm, prompts, args.decode_steps, "before")
        # the rebalance sees exactly the before run's steps (the warm-up's are older)
        core.eplb.config = dataclasses.replace(core.eplb.config, window_size=before["steps"])
        rebalances = core.eplb.num_rebalances
        t = time.perf_counter()
        core.rebalance_experts()
        res["rebalance_call_s"] = time.perf_counter() - t
        res["rebalance_move_s"] = core.eplb.last_seconds
        if core.eplb.num_rebalances != rebalances + 1:
            raise RuntimeError("rebalance_experts() did not rebalance (no load in the window?)")
        res["predicted_after"] = float(balancedness(gpu_loads(counts_LE, core.eplb.placement, core.eplb.ep_size))
                                       .mean())
        after, after_tokens, counts_after_LE = run_workload(llm, prompts, args.decode_steps, "after")
        res.update(before=before, after=after, same_routing=bool((counts_after_LE == counts_LE).all()),
                   after_vs_before=compare_tokens(before_tokens, after_tokens))
        if warm_tokens is not None:
            res["before_vs_warmup"] = compare_tokens(warm_tokens, before_tokens)
        res["tokens_identical"] = res["after_vs_before"]["identical"] == len(prompts)
        res["case_s"] = time.perf_counter() - t0
        return res, before_tokens
    finally:
        llm.shutdown()


def baseline_case(args: argparse.Namespace, model: str, prompts: list[dict]) -> tuple[dict, dict]:
    t0 = time.perf_counter()
    with LLM(model, enable_eplb=False, **_engine_kwargs(args, model)) as llm:
        res = {"start_s": time.perf_counter() - t0}
        if args.warmup:
            run_workload(llm, prompts, args.decode_steps, "warm")
        run, tokens, _ = run_workload(llm, prompts, args.decode_steps, "run")
        res.update(run=run, case_s=time.perf_counter() - t0)
        return res, tokens


# ---- the run ------------------------------------------------------------------------------
def _dummy_qwen3_30b(max_model_len: int) -> str:
    path = tempfile.mkdtemp(prefix="eplb_qwen3_30b_")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**QWEN3_30B_A3B, "max_position_embeddings": max(max_model_len, 4096)}, f)
    return path


def _vocab_size(model: str) -> int:
    from models.registry import load_model_config
    from moe.engine.model_info import resolve_model_path

    return load_model_config(resolve_model_path(model))[1].vocab_size


def print_table(results: dict) -> None:
    print(f"{'case':<14}{'bal before':>18}{'bal after':>18}{'step ms before':>16}{'step ms after':>15}"
          f"{'move s':>9}{'tokens same':>13}")
    for name, r in results["cases"].items():
        if "error" in r or "skipped" in r:
            print(f"{name:<14}{r.get('error') or r.get('skipped')}")
        elif "run" in r:
            b = r["run"]["balancedness"]
            print(f"{name:<14}{b['mean']:>10.3f} / {b['min']:.3f}{'':>18}{r['run']['median_step_ms']:>16.2f}")
        else:
            bb, ba = r["before"]["balancedness"], r["after"]["balancedness"]
            print(f"{name:<14}{bb['mean']:>10.3f} / {bb['min']:.3f}{ba['mean']:>11.3f} / {ba['min']:.3f}"
                  f"{r['before']['median_step_ms']:>16.2f}{r['after']['median_step_ms']:>15.2f}"
                  f"{r['rebalance_move_s']:>9.3f}{str(r['tokens_identical']):>13}")
    print("balancedness: mean / min over MoE layers, whole workload; decode-only balance is in the JSON")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the JSON written (after every case)")
    p.add_argument("--checkpoint", default=None, help="a config-only folder (dummy weights) or a checkpoint; "
                   "default: a Qwen3-30B-A3B-shaped config-only folder made here")
    p.add_argument("--tiny", action="store_true", help="the built-in tiny model (tiny-qwen3-moe), for a CPU check")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--redundant", type=int, nargs="+", default=None,
                   help="num_redundant_experts of each EPLB case (default 0 32; with --tiny 0 4)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the case without EPLB")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up pass of each case")
    p.add_argument("--num-requests", type=int, default=256, help="running sequences, over both DP ranks")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=32, help="tokens generated per request")
    p.add_argument("--distinct-tokens", type=int, default=64)
    p.add_argument("--zipf-exponent", type=float, default=1.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-parallel-size", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=None, help="per DP rank; default num_requests / DP")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--deadline-s", type=float, default=540.0, help="no case starts that would end after this")
    args = p.parse_args(argv)
    if args.redundant is None:
        args.redundant = [0, 4] if args.tiny else [0, 32]
    for name in ("num_requests", "prompt_len", "decode_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.decode_steps < 2:
        p.error("--decode-steps must be >= 2 (the first token comes with the prefill: nothing to time)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    end = time.monotonic() + args.deadline_s
    model = "tiny-qwen3-moe" if args.tiny else args.checkpoint or _dummy_qwen3_30b(args.prompt_len + args.decode_steps)
    vocab = _vocab_size(model)
    prompts = skewed_prompts(args.num_requests, args.prompt_len, vocab, args.distinct_tokens, args.zipf_exponent,
                             args.seed)
    results = {"model": model, "args": vars(args), "cases": {}}
    if args.device == "cuda":
        import torch

        results["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    ids, probs = zipf_token_ids(vocab, args.distinct_tokens, args.zipf_exponent, args.seed)
    results["skew"] = {"top1_share": float(probs[0]), "top8_share": float(probs[:8].sum())}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)

    cases = [(f"eplb_r{r}", r) for r in args.redundant] + ([("baseline", None)] if args.baseline else [])
    slowest, eplb_tokens = 0.0, None
    failed = False
    for name, redundant in cases:
        left = end - time.monotonic()
        if left < 1.2 * slowest or left < 5:
            results["cases"][name] = {"skipped": f"--deadline-s: {max(left, 0):.0f} s left, the slowest case took "
                                                 f"{slowest:.0f} s"}
            failed = True
            continue
        t = time.perf_counter()
        try:
            if redundant is None:
                res, tokens = baseline_case(args, model, prompts)
                if eplb_tokens is not None:  # informative: EPLB's initial placement against the static one
                    res["eplb_before_vs_baseline"] = compare_tokens(tokens, eplb_tokens)
            else:
                res, eplb_tokens = eplb_case(args, model, prompts, redundant)
                failed |= not res["tokens_identical"]
        except Exception as exc:  # the other cases still run; the run fails
            res, failed = {"error": f"{type(exc).__name__}: {exc}"}, True
        slowest = max(slowest, time.perf_counter() - t)
        results["cases"][name] = res
        save()
        print(f"{name}: {json.dumps({k: v for k, v in res.items() if k not in ('before', 'after', 'run')})}",
              flush=True)
    results["ok"] = not failed
    save()
    print_table(results)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
