"""Build the tiny random checkpoints the GPU checks compare against the CPU (run on the CPU
machine, then carry the folder to the GPU machine): one per model family, with dimensions that
exercise multi-block contexts, GQA and, for Llama-4, chunk boundaries of the local attention.

    python benchmarks/make_gpu_checkpoints.py .gpu_ckpts          # every family
    python benchmarks/make_gpu_checkpoints.py .gpu_ckpts --new    # Mixtral, GLM-4.5, MiniMax-M2, gpt-oss only
    python benchmarks/make_gpu_checkpoints.py .gpu_ckpts --hybrid # Qwen3-Next, Qwen3.5-MoE only
"""
from __future__ import annotations

import os
import sys

from tests.factories import make_qwen3_moe_checkpoint
from tests.factories_deepseek import make_deepseek_v3_checkpoint
from tests.factories_glm4_moe import make_glm4_moe_checkpoint
from tests.factories_gpt_oss import make_gpt_oss_mxfp4_checkpoint
from tests.factories_llama4 import make_llama4_model, save_llama4_checkpoint
from tests.factories_minimax_m2 import make_minimax_m2_checkpoint
from tests.factories_mixtral import make_mixtral_checkpoint
from tests.factories_qwen3_next import make_qwen3_next_checkpoint


def main(out: str, only: list[str] | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    if only == ["hybrid"]:  # prompts beyond the delta rule's 64-token chunks and the 16-token blocks
        for arch in ("qwen3_next", "qwen3_5_moe"):
            make_qwen3_next_checkpoint(os.path.join(out, arch), arch=arch, max_position_embeddings=1024)
        print("checkpoints in", out)
        return
    # The families added later (#34); `--new` builds only these.
    make_mixtral_checkpoint(os.path.join(out, "mixtral"), max_position_embeddings=1024)
    make_glm4_moe_checkpoint(os.path.join(out, "glm4_moe"))
    make_minimax_m2_checkpoint(os.path.join(out, "minimax_m2"))
    # the hub's MXFP4 layout, and its dense twin (transformers' layout); contexts beyond the window
    make_gpt_oss_mxfp4_checkpoint(os.path.join(out, "gpt_oss_mxfp4"), os.path.join(out, "gpt_oss"),
                                  max_position_embeddings=1024)
    if only == ["new"]:
        print("checkpoints in", out)
        return
    make_qwen3_moe_checkpoint(os.path.join(out, "qwen3_moe"), num_attention_heads=8, num_key_value_heads=2,
                              head_dim=32, max_position_embeddings=1024)
    make_deepseek_v3_checkpoint(os.path.join(out, "deepseek_v3"))
    save_llama4_checkpoint(make_llama4_model(attention_chunk_size=32), os.path.join(out, "llama4_mm"),
                           layout="multimodal")
    print("checkpoints in", out)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a not in ("--new", "--hybrid")]
    only = ["new"] if "--new" in sys.argv else ["hybrid"] if "--hybrid" in sys.argv else None
    main(args[0] if args else ".gpu_ckpts", only)
