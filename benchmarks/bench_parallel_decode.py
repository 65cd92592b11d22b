"""Decode-step time of a Qwen3-30B-A3B-shaped model (dummy weights, reduced depth) under
parallel layouts on 2 GPUs (NCCL), through the whole engine (scheduler, spawned workers,
sampling on the driver rank):

  tp2      tensor_parallel_size=2: attention and experts sharded (experts along F), all-reduces
  tp2-ep   tensor_parallel_size=2 + enable_expert_parallel: attention TP, 64 whole experts per GPU,
           the TP ranks split the tokens and dispatch them (EP=2)
  dp2-ep   data_parallel_size=2 + enable_expert_parallel: two engine cores (attention data
           parallel, half the requests each), experts EP=2 over both
  tp1      one GPU, no parallelism (optional baseline)

For each layout and batch size B: B requests with random prompts are prefilled, then
--decode-steps engine steps are timed (every request decodes one token per step).

    python benchmarks/bench_parallel_decode.py                      # 2 GPUs, 8 layers, B=1,16,64,256
    python benchmarks/bench_parallel_decode.py --num-layers 48 --layouts tp2,tp2-ep,dp2-ep,tp1 \
        --all2all-backend all_to_all --out benchmarks/results/parallel_decode.json
    python benchmarks/bench_parallel_decode.py --smoke              # tiny shapes, 2 CPU processes, gloo

Other layouts: any tp<N>, tp<N>-ep, dp<N>, dp<N>-ep (e.g. dp8-ep = data_parallel_size=8 +
enable_expert_parallel, eight engine cores, EP=8). --model-shape deepseek-v3 writes a DeepSeek-V3
config.json (real dimensions: MLA, 256 experts top-8, group-limited routing, 1 shared expert,
first 3 layers dense; bf16 dummy weights) with num_hidden_layers reduced to --num-layers.
--batch-per-replica reads --batch-sizes per data-parallel replica (B x dp requests in all):

    python benchmarks/bench_parallel_decode.py --model-shape deepseek-v3 --num-layers 8 \
        --layouts dp8-ep --batch-sizes 64,256 --batch-per-replica --all2all-backend all_to_all
    python benchmarks/bench_parallel_decode.py --smoke --model-shape deepseek-v3 --layouts dp8-ep \
        --batch-per-replica                                       # tiny, 8 CPU processes, gloo
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

from moe.bench.common import DEEPSEEK_V3, QWEN3_30B_A3B  # noqa: E402

SMOKE = {**QWEN3_30B_A3B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
         "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "float32"}

# DeepSeek-V3 (the hub's config.json less quantization_config: dummy weights are bf16).
SMOKE_DEEPSEEK_V3 = {**DEEPSEEK_V3, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
                     "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
                     "n_routed_experts": 32, "num_experts_per_tok": 4, "kv_lora_rank": 32, "q_lora_rank": 48,
                     "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16, "first_k_dense_replace": 1,
                     "max_position_embeddings": 512, "torch_dtype": "float32"}
SHAPES = {"qwen3-30b-a3b": (QWEN3_30B_A3B, SMOKE), "deepseek-v3": (DEEPSEEK_V3, SMOKE_DEEPSEEK_V3)}

LAYOUTS = {
    "tp1": dict(),
    "tp2": dict(tensor_parallel_size=2),
    "tp2-ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "dp2-ep": dict(data_parallel_size=2, enable_expert_parallel=True),
}


# Dummy weights are uniform in +-1e-3, DeepSeek-V3's router correction bias too, and it dwarfs the
# router's logits (~1e-5 apart with dummy norms and embeddings): every token then picks the same
# experts, all on the same few ranks, a hot-spot no real checkpoint has. --router-bias zero (the
# default) zeroes that bias after the dummy init, so the experts follow each token's logits
# (measured on the smoke shape: 129 distinct expert sets of 152 routed tokens, against 1 of 152).
# The workers are spawned processes that re-import this script (and inherit the environment):
# the variable below makes the patch apply there too.
_ZERO_BIAS_ENV = "MOE_BENCH_ZERO_ROUTER_BIAS"


def zero_router_bias_on_dummy_init() -> None:
    """Make load_format="dummy" leave every `e_score_correction_bias` at zero, in this process."""
    import torch

    import models.loader as loader
    import moe.worker.worker as worker
    orig = loader.init_dummy_weights
    if getattr(orig, "zeroes_router_bias", False):
        return

    def init_dummy_weights(model, *args, **kwargs):
        orig(model, *args, **kwargs)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if pname.endswith("e_score_correction_bias"):
                    param.zero_()

    init_dummy_weights.zeroes_router_bias = True
    loader.init_dummy_weights = init_dummy_weights
    if hasattr(worker, "init_dummy_weights"):  # imported by name there
        worker.init_dummy_weights = init_dummy_weights


if os.environ.get(_ZERO_BIAS_ENV) == "1":  # a spawned worker of a run with --router-bias zero
    zero_router_bias_on_dummy_init()


def layout_kwargs(name: str) -> dict:
    """LLM keyword arguments of a layout: the named ones above, or tp<N>[-ep] / dp<N>[-ep]."""
    if name in LAYOUTS:
        return LAYOUTS[name]
    m = re.fullmatch(r"(tp|dp)(\d+)(-ep)?", name)
    if not m or int(m.group(2)) < 1:
        raise SystemExit(f"unknown layout {name!r}; choose from {list(LAYOUTS)} or tp<N>, tp<N>-ep, dp<N>, dp<N>-ep")
    kw = {"tensor_parallel_size" if m.group(1) == "tp" else "data_parallel_size": int(m.group(2))}
    return {**kw, "enable_expert_parallel": True} if m.group(3) else kw


def _running(engine) -> list:
    return [r for s in engine.schedulers for r in s.running]


def bench_layout(model_dir: str, name: str, args, vocab: int) -> list[dict]:
    from moe import LLM, SamplingParams

    layout = layout_kwargs(name)
    dp = layout.get("data_parallel_size", 1)
    per_replica = [int(b) for b in args.batch_sizes.split(",")]
    batch_sizes = [b * dp for b in per_replica] if args.batch_per_replica else per_replica
    extra = dict(all2all_backend=args.all2all_backend) if "ep" in name else {}
    t0 = time.perf_counter()
    llm = LLM(model_dir, load_format="dummy", dtype=args.dtype, device=args.device,
              max_model_len=args.prompt_len + args.decode_steps + args.warmup_steps + 8,
              max_num_seqs=max(batch_sizes), enable_prefix_caching=False,
              gpu_memory_utilization=args.gpu_memory_utilization, **layout, **extra)
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    rng = random.Random(0)
    rows = []
    try:
        for B in batch_sizes:
            params = SamplingParams(temperature=0.0, ignore_eos=True,
                                    max_tokens=args.decode_steps + args.warmup_steps + 2)
            ids = [f"{name}-{B}-{i}" for i in range(B)]
            for rid in ids:
                engine.add_request(rid, {"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(args.prompt_len)]},
                                   params)
            while not (len(_running(engine)) == B
                       and all(r.num_computed_tokens == r.num_tokens - 1 for r in _running(engine))):
                engine.step()  # prefill (possibly over several steps)
            for _ in range(args.warmup_steps):
                engine.step()
            times = []
            for _ in range(args.decode_steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            engine.abort_request(ids)
            while engine.has_unfinished_requests():
                engine.step()
            engine.step()  # the runners drop the aborted requests
            times.sort()
            med = times[len(times) // 2]
            row = {"layout": name, "batch": B, "decode_step_ms_median": 1e3 * med,
                   "decode_step_ms_mean": 1e3 * sum(times) / len(times), "decode_step_ms_min": 1e3 * times[0],
                   "tokens_per_s": B / med, "load_s": load_s, "num_layers": args.num_layers,
                   "all2all_backend": extra.get("all2all_backend"), "router_bias": args.router_bias}
            row.update(model_shape=args.model_shape, batch_per_replica=B / dp, tokens_per_s_per_replica=B / dp / med)
            rows.append(row)
            if _is_rank0():
                print(f"{name:7s} B={B:4d}  decode step {row['decode_step_ms_median']:8.2f} ms (median; min "
                      f"{row['decode_step_ms_min']:.2f})  {row['tokens_per_s']:10.1f} tok/s", flush=True)
    finally:
        engine.shutdown()
        del llm, engine
    return rows


def _is_rank0() -> bool:
    """Under torchrun every rank runs this script (and the whole engine): only rank 0 reports."""
    return int(os.environ.get("RANK", "0")) == 0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="tp2,tp2-ep,dp2-ep",
                   help=f"comma-separated, of {list(LAYOUTS)} or tp<N>, tp<N>-ep, dp<N>, dp<N>-ep")
    p.add_argument("--model-shape", default="qwen3-30b-a3b", choices=sorted(SHAPES),
                   help="the config.json written (real dimensions; depth from --num-layers)")
    p.add_argument("--num-layers", type=int, default=8,
                   help="decoder layers (the real Qwen3-30B-A3B has 48, DeepSeek-V3 61)")
    p.add_argument("--first-k-dense", type=int, default=None,
                   help="deepseek-v3: dense layers before the MoE ones (default the model's 3; smoke 1)")
    p.add_argument("--router-bias", choices=["zero", "dummy"], default="zero",
                   help="DeepSeek-V3's router correction bias after the dummy init: zero (tokens spread "
                        "over the experts by their logits) or dummy (+-1e-3: every token to the same experts)")
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--batch-per-replica", action="store_true",
                   help="--batch-sizes are requests per data-parallel replica (B x dp in all), not in all")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--all2all-backend", default="auto",
                   choices=["auto", "allgather_reducescatter", "all_to_all", "low_latency"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on 2 CPU processes (gloo): a quick check")
    args = p.parse_args(argv)
    full, smoke = SHAPES[args.model_shape]
    cfg = dict(full)
    if args.smoke:
        cfg = dict(smoke)
        args.device, args.dtype = "cpu", "float32"
        args.batch_sizes, args.prompt_len, args.decode_steps, args.warmup_steps = "1,4", 8, 3, 1
        args.num_layers = min(args.num_layers, 2)
    cfg["num_hidden_layers"] = args.num_layers
    if args.router_bias == "zero":
        os.environ[_ZERO_BIAS_ENV] = "1"  # inherited by the spawned workers
        zero_router_bias_on_dummy_init()  # the in-process (tp1) and torchrun cases
    if args.first_k_dense is not None and "first_k_dense_replace" in cfg:
        cfg["first_k_dense_replace"] = args.first_k_dense
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(cfg, f)
        names = args.layouts.split(",")
        for name in names:
            layout_kwargs(name)  # every name checked before the first engine starts
        for name in names:
            rows += bench_layout(model_dir, name, args, cfg["vocab_size"])
    if not _is_rank0():
        return
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
