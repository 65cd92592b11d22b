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
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 151645,
}
SMOKE = {**QWEN3_30B_A3B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
         "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "float32"}

LAYOUTS = {
    "tp1": dict(),
    "tp2": dict(tensor_parallel_size=2),
    "tp2-ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "dp2-ep": dict(data_parallel_size=2, enable_expert_parallel=True),
}


def _running(engine) -> list:
    return [r for s in engine.schedulers for r in s.running]


def bench_layout(model_dir: str, name: str, args, vocab: int) -> list[dict]:
    from moe import LLM, SamplingParams

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    extra = dict(all2all_backend=args.all2all_backend) if "ep" in name else {}
    t0 = time.perf_counter()
    llm = LLM(model_dir, load_format="dummy", dtype=args.dtype, device=args.device,
              max_model_len=args.prompt_len + args.decode_steps + args.warmup_steps + 8,
              max_num_seqs=max(batch_sizes), enable_prefix_caching=False,
              gpu_memory_utilization=args.gpu_memory_utilization, **LAYOUTS[name], **extra)
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
                   "all2all_backend": extra.get("all2all_backend")}
            rows.append(row)
            print(f"{name:7s} B={B:4d}  decode step {row['decode_step_ms_median']:8.2f} ms (median; min "
                  f"{row['decode_step_ms_min']:.2f})  {row['tokens_per_s']:10.1f} tok/s", flush=True)
    finally:
        engine.shutdown()
        del llm, engine
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="tp2,tp2-ep,dp2-ep", help=f"comma-separated, of {list(LAYOUTS)}")
    p.add_argument("--num-layers", type=int, default=8, help="decoder layers (the real model has 48)")
    p.add_argument("--batch-sizes", default="1,16,64,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--all2all-backend", default="auto", choices=["auto", "allgather_reducescatter", "all_to_all"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on 2 CPU processes (gloo): a quick check")
    args = p.parse_args()
    cfg = dict(QWEN3_30B_A3B)
    if args.smoke:
        cfg = dict(SMOKE)
        args.device, args.dtype = "cpu", "float32"
        args.batch_sizes, args.prompt_len, args.decode_steps, args.warmup_steps = "1,4", 8, 3, 1
        args.num_layers = min(args.num_layers, 2)
    cfg["num_hidden_layers"] = args.num_layers
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(cfg, f)
        for name in args.layouts.split(","):
            if name not in LAYOUTS:
                raise SystemExit(f"unknown layout {name!r}; choose from {list(LAYOUTS)}")
            rows += bench_layout(model_dir, name, args, cfg["vocab_size"])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
