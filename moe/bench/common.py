"""Pieces several benchmarks share: the Qwen3-30B-A3B shape and the torchrun process group."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.distributed as dist

# Qwen3-30B-A3B's config.json (the dims that matter), for dummy-weight runs.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 151645,
}


@contextlib.contextmanager
def torchrun_process_group() -> Iterator[torch.device]:
    """The default process group of a torchrun launch (NCCL, one GPU per local rank; gloo on
    the CPU with the cores shared out), created if needed and destroyed if created here.
    Yields this rank's device."""
    created = not dist.is_initialized()
    if created:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        yield torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    finally:
        if created:
            dist.destroy_process_group()
