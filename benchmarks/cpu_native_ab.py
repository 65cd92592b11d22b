"""The CPU path's native kernels (kernels/cpu_native) against their torch twins, on the workload of
`moe bench engine-cpu` (the built-in tiny-qwen3-moe: hidden 256, 8 heads / 4 KV heads of 32, 16
experts top-4 of 128, 64 sequences, float32):

- per call at a decode step's shapes (64 sequences of 150-189 tokens, blocks of 16): decode
  attention with the cache warm and cold (64 MB written between calls, as the other layers'
  weights and caches pass through in a step), the expert layer, RMSNorm + residual, q/k norm + RoPE;
- end to end: 64 prompts x 128 random ids, 64 greedy tokens, best of 3 `generate` calls
  (bench_cpu_vs_vllm.py's worker), in fresh processes taking turns: every native kernel, none
  (MOE_CPU_NATIVE=0), and every one but the expert layer.

    python benchmarks/cpu_native_ab.py --rounds 2 --out benchmarks/results/cpu_native_ab.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _us(fn, n: int, between=None) -> float:
    fn()
    total = 0.0
    for _ in range(n):
        if between is not None:
            between()
        t = time.perf_counter()
        fn()
        total += time.perf_counter() - t
    return total / n * 1e6


def kernels_side_by_side() -> dict:
    import torch

    import kernels.cpu_attention as cpu_attention
    from kernels import cpu_experts, cpu_native
    from models.config import RopeConfig
    from models.layers.norm import RMSNorm
    from models.layers.rotary import RotaryEmbedding
    from moe.worker.cpu_memory import keep_freed_memory
    from tests.kernels.attention_cases import paged_batch

    keep_freed_memory()  # as a CPU worker does (fresh activations without page faults)
    g = torch.Generator().manual_seed(0)
    batch = paged_batch([(150 + i % 40, 1) for i in range(64)], 16, H=8, G=4, d=32, stale_cache=True)
    out = torch.empty_like(batch.q)
    junk = torch.randn(16 * 2 ** 20)  # 64 MB

    def attention():
        cpu_attention._decode(out, batch.q, batch.cache, batch.meta, batch.scale, None, True)

    x, res = torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)
    w13, w2 = torch.randn(16, 256, 256, generator=g) * 0.06, torch.randn(16, 256, 128, generator=g) * 0.09
    weights, ids = torch.randn(64, 16, generator=g).softmax(-1).topk(4, -1)
    norm = RMSNorm(256)
    rope = RotaryEmbedding(32, 4096, RopeConfig(theta=1e6))
    q_norm, k_norm = RMSNorm(32), RMSNorm(32)
    qkv = torch.randn(64, 16 * 32, generator=g)
    q, k = qkv[:, :256].view(64, 8, 32), qkv[:, 256:384].view(64, 4, 32)
    pos = torch.randint(0, 4096, (64,), generator=g)
    cases = {
        "decode attention, warm": (attention, None),
        "decode attention, cold": (attention, lambda: junk.add_(1.0)),
        "expert layer": (lambda: cpu_experts.fused_experts_cpu(x, w13, w2, weights, ids), None),
        "rms_norm + residual": (lambda: norm(x, res), None),
        "q/k norm + rope": (lambda: rope.forward_with_qk_norm(pos, q, k, q_norm, k_norm), None),
    }
    real = cpu_native.library
    rows = {}
    with torch.inference_mode():  # as the model runner runs (torch's SDPA is slower outside it)
        for name, (fn, between) in cases.items():
            native = _us(fn, 100, between)
            cpu_native.library = lambda: None
            try:
                twin = _us(fn, 100, between)
            finally:
                cpu_native.library = real
            rows[name] = {"native_us": round(native, 1), "torch_us": round(twin, 1)}
            print(f"{name:<26} native {native:8.1f} us   torch {twin:8.1f} us", flush=True)
    return rows


# End-to-end variants, each in a fresh process: env of the process, and whether its worker keeps
# the expert layer on torch's grouped GEMM (the other native kernels on).
VARIANTS = {"native": ({"MOE_CPU_NATIVE": "1"}, False), "torch": ({"MOE_CPU_NATIVE": "0"}, False),
            "native, torch experts": ({"MOE_CPU_NATIVE": "1"}, True)}


def _generate_worker(torch_experts: bool) -> None:
    from benchmarks.bench_cpu_vs_vllm import _worker_ours

    if torch_experts:
        from kernels.cpu_native import ops
        ops.experts = lambda *args: None
    print(json.dumps(_worker_ours(argparse.Namespace(model_path="tiny-qwen3-moe", num_prompts=64, input_len=128,
                                                     output_len=64, repeats=3))))


def end_to_end(rounds: int) -> list[dict]:
    rows = []
    for r in range(rounds):
        for name, (env, torch_experts) in VARIANTS.items():
            cmd = [sys.executable, __file__, "--worker"] + (["--torch-experts"] if torch_experts else [])
            proc = subprocess.run(cmd, env={**os.environ, **env}, cwd=ROOT, check=True, capture_output=True,
                                  text=True)
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            runs = [round(run["output_tok_per_s"]) for run in result["runs"]]
            rows.append({"round": r, "variant": name, "output_tok_s": runs, "best": max(runs),
                         "loadavg": os.getloadavg(), "tokens": result["tokens"]})
            print(f"round {r} {name}: best {max(runs)} output tok/s (runs {runs})", flush=True)
    same = all(row["tokens"] == rows[0]["tokens"] for row in rows)
    print(f"identical greedy tokens in every variant: {same}")
    for row in rows:
        row.pop("tokens")
        row["identical_tokens"] = same
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torch-experts", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    if args.worker:
        _generate_worker(args.torch_experts)
        return
    import torch

    result = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "kernels": kernels_side_by_side(), "end_to_end": end_to_end(args.rounds)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
