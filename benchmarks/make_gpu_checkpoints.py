"""Build the tiny random checkpoints the GPU checks compare against the CPU (run on the CPU
machine, then carry the folder to the GPU machine): one per model family, with dimensions that
exercise multi-block contexts, GQA and, for Llama-4, chunk boundaries of the local attention.

    python benchmarks/make_gpu_checkpoints.py .gpu_ckpts
"""
from __future__ import annotations

import os
import sys

from tests.factories import make_qwen3_moe_checkpoint
from tests.factories_deepseek import make_deepseek_v3_checkpoint
from tests.factories_llama4 import make_llama4_model, save_llama4_checkpoint


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    make_qwen3_moe_checkpoint(os.path.join(out, "qwen3_moe"), num_attention_heads=8, num_key_value_heads=2,
                              head_dim=32, max_position_embeddings=1024)
    make_deepseek_v3_checkpoint(os.path.join(out, "deepseek_v3"))
    save_llama4_checkpoint(make_llama4_model(attention_chunk_size=32), os.path.join(out, "llama4_mm"),
                           layout="multimodal")
    print("checkpoints in", out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".gpu_ckpts")
