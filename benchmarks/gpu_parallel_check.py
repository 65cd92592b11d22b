"""Parallel layouts on GPUs (NCCL) give the single-GPU greedy tokens (fp32).

    python benchmarks/gpu_parallel_check.py CKPT_DIR --out results.json
"""
from __future__ import annotations

import argparse
import json
import random

from moe import LLM, SamplingParams

LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "tp2_ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "dp2_ep2_all_to_all": dict(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="all_to_all"),
    "dp2_ep2_allgather": dict(data_parallel_size=2, enable_expert_parallel=True,
                              all2all_backend="allgather_reducescatter"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    common = dict(device="cuda", dtype="float32", max_model_len=128, num_gpu_blocks_override=256)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(n)]} for n in (1, 6, 17, 40, 3, 25)]
    ref = [o.outputs[0].token_ids for o in LLM(args.checkpoint, **common).generate(prompts, params, use_tqdm=False)]
    results = {}
    for name, kwargs in LAYOUTS.items():
        llm = LLM(args.checkpoint, **common, **kwargs)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.llm_engine.shutdown()
        same = sum(a == b for a, b in zip(ref, got))
        results[name] = {"identical": same, "of": len(prompts)}
        print(f"{name}: {same}/{len(prompts)} sequences identical to one GPU")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
