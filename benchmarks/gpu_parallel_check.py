"""Parallel layouts on GPUs (NCCL) give the single-GPU greedy tokens (fp32 by default).

    python benchmarks/gpu_parallel_check.py CKPT_DIR --out results.json
    # an FP8 block checkpoint (routed experts served FP8 by the Triton kernel), against its
    # dequantised twin on one GPU as well:
    python benchmarks/gpu_parallel_check.py FP8_DIR --layouts tp2 tp2_ep2 --twin TWIN_DIR
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
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--twin", default=None,
                        help="a second checkpoint (e.g. the dequantised twin of an FP8 one) "
                             "compared with the first on one GPU")
    args = parser.parse_args(argv)
    common = dict(device="cuda", dtype=args.dtype, max_model_len=128, num_gpu_blocks_override=256)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(n)]} for n in (1, 6, 17, 40, 3, 25)]
    one = LLM(args.checkpoint, **common)
    ref = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    experts = next((m for m in one.llm_engine.executor.model.modules()
                    if hasattr(m, "w13_weight")), None)
    one.llm_engine.shutdown()
    results = {"routed_expert_dtype": None if experts is None else str(experts.w13_weight.dtype)}
    print(f"routed experts held as {results['routed_expert_dtype']}")
    if args.twin:
        twin = LLM(args.twin, **common)
        got = [o.outputs[0].token_ids for o in twin.generate(prompts, params, use_tqdm=False)]
        twin.llm_engine.shutdown()
        same = sum(a == b for a, b in zip(ref, got))
        first = sum(a[0] == b[0] for a, b in zip(ref, got))
        results["twin"] = {"identical": same, "first_token_identical": first, "of": len(prompts)}
        print(f"twin on one GPU: {same}/{len(prompts)} sequences identical, first token "
              f"{first}/{len(prompts)}")
    for name in args.layouts:
        kwargs = LAYOUTS[name]
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
