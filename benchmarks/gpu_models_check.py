"""Each model family generates the same greedy tokens on the GPU as on the CPU (fp32).

    python benchmarks/gpu_models_check.py CKPT_DIR [CKPT_DIR ...] --out results.json

Checkpoint folders are tiny random Hugging Face checkpoints (the test factories make them);
on the GPU the expert layer runs once with the torch reference and once with the Triton kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import random

import torch

from models.registry import load_model_config
from moe import LLM, SamplingParams


def compare_gpu_to_cpu(model: str, prompts: list, params: SamplingParams, **llm_kwargs) -> dict[str, dict]:
    """Greedy tokens on the GPU (fp32; torch and Triton experts) against the CPU's, per backend."""
    cpu = [o.outputs[0].token_ids for o in
           LLM(model, device="cpu", dtype="float32", **llm_kwargs).generate(prompts, params, use_tqdm=False)]
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(model, device="cuda", dtype="float32", moe_backend=backend, gpu_memory_utilization=0.3, **llm_kwargs)
        gpu = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        results[backend] = {"identical": sum(a == b for a, b in zip(cpu, gpu)), "of": len(prompts),
                            "first_divergence": [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                                 for a, b in zip(cpu, gpu)]}
        del llm
        torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--out", default=None)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    results = {}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for path in args.checkpoints:
        name = os.path.basename(os.path.normpath(path))
        vocab = load_model_config(path)[1].vocab_size
        rng = random.Random(0)
        prompts = [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(n)]} for n in (1, 6, 17, 40)]
        for backend, r in compare_gpu_to_cpu(path, prompts, params, max_model_len=128).items():
            results[f"{name}/{backend}"] = r
            print(f"{name}: GPU ({backend} experts) vs CPU greedy: {r['identical']}/{r['of']} identical")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
