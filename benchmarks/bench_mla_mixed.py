"""MLA attention of a mixed step, the forms of models/layers/mla_attention.py's GPU path: every query
row absorbed (what a mixed step's CUDA graph captures), the chunks' tokens a split-KV program each
(`absorbed`, MOE_MLA_CHUNK_ROWS=0) or packed 32 / 64 rows a program (`packed32`, `packed64`:
kernels/triton_attention/mla_chunks.py), against the prefill rows expanded (context gather,
kv_b_proj, varlen attention; eager steps) beside the absorbed decode rows. One layer's attention core (no
projections: the same in both), bf16, eager launches timed with triton.testing.do_bench, the
per-forward layout derivation done once beforehand (the layers of a forward share it).

    python benchmarks/bench_mla_mixed.py --out mla_mixed.json

Shapes: DeepSeek-V3 (128 heads) and Moonlight-16B-A3B (16 heads), kv_lora_rank 512, rope 64.
Steps: decode rows x their context + chunks x (new tokens @ cached tokens). The absorbed form
costs ~2 x heads x (576 + 512) FLOPs a (query, key) pair; the expanded one makes each context
row's per-head keys and values once (2 x 512 x heads x 256 FLOPs a context row), then 2 x heads x
(192 + 128) a pair: long chunks favour it (MOE_MLA_ABSORBED_HEAD_PAIRS: the graphs' limit).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"deepseek-v3": dict(num_heads=128, q_lora_rank=1536, hidden_size=7168),
          "moonlight-16b-a3b": dict(num_heads=16, q_lora_rank=None, hidden_size=2048)}
# (decode rows, their context, [(chunk tokens, cached tokens), ...])
STEPS = [(255, 540, [(64, 0)]), (255, 540, [(512, 0)]), (255, 540, [(2048, 0)]), (64, 540, [(512, 2048)]),
         (128, 540, [(256, 3840)]), (0, 0, [(512, 0)] * 4), (16, 1024, [(1024, 1024)] * 2)]


def layer_for(shape: str, device: str):
    from models.config import RopeConfig
    from models.layers.mla_attention import MLAAttention, MLAConfig
    cfg = MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    max_position_embeddings=8192, rope=RopeConfig(10000.0), **SHAPES[shape])
    layer = MLAAttention(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.02)
    return layer.to(device, torch.bfloat16)


def time_step(layer, decodes: int, decode_ctx: int, chunks: list, device: str,
              dtype: torch.dtype = torch.bfloat16) -> dict:
    import triton

    import models.layers.mla_attention as mla
    from tests.factories_deepseek import mla_step_metadata
    new = [1] * decodes + [n for n, _ in chunks]
    cached = [decode_ctx - 1] * decodes + [c for _, c in chunks]
    S = 16
    per = max(-(-(c + n) // S) for n, c in zip(new, cached))
    c = layer.cfg
    layer.kv_cache = torch.randn(len(new) * per + 1, S, c.kv_lora_rank + c.qk_rope_head_dim, device=device).to(dtype)
    T, H = sum(new), layer.num_local_heads
    q_nope = torch.randn(T, H, c.qk_nope_head_dim, device=device, dtype=dtype)
    q_pe = torch.randn(T, H, c.qk_rope_head_dim, device=device, dtype=dtype)
    # what MLAAttention.mixed_graph_fits weighs against MOE_MLA_ABSORBED_HEAD_PAIRS
    head_pairs = H * sum(n * (n + c) for n, c in chunks)
    out = {"tokens": T, "decodes": decodes, "decode_ctx": decode_ctx, "chunks": chunks, "head_pairs": head_pairs,
           "graph_fits": head_pairs <= mla.ABSORBED_MAX_HEAD_PAIRS}
    for form, chunk_rows in (("expanded", 0), ("absorbed", 0), ("packed32", 32), ("packed64", 64)):
        mla.CHUNK_ROWS = chunk_rows
        meta, _ = mla_step_metadata(new, cached, S, layer.kv_cache.shape[0], device)
        meta.host_lists = form == "expanded"  # as a mixed step's graph marks its placeholders
        run = lambda: layer._attend_triton(q_nope, q_pe, meta)  # noqa: E731
        result = run()  # compiles, and derives the forward's layout once
        out[f"{form}_us"] = round(1e3 * triton.testing.do_bench(run, warmup=10, rep=60), 1)
        out[f"{form}_out"] = result.float()
    ref = out.pop("expanded_out")
    for form in ("absorbed", "packed32", "packed64"):
        out[f"{form}_rel_diff"] = float((out.pop(f"{form}_out") - ref).norm() / ref.norm())
        out[f"{form}_over_expanded"] = round(out[f"{form}_us"] / out["expanded_us"], 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda"
    results = {"device": torch.cuda.get_device_name(), "command": "python benchmarks/bench_mla_mixed.py", "rows": []}
    for shape in SHAPES:
        layer = layer_for(shape, device)
        for decodes, ctx, chunks in STEPS:
            row = {"shape": shape, **time_step(layer, decodes, ctx, chunks, device)}
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
        del layer
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
