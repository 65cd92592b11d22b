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

# DeepSeek-V3's config.json (the dims that matter), for dummy-weight runs.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0,
    "eos_token_id": 1,
}
# 32 experts in 8 groups: divisible by EP=8, one group per rank as in the real model at EP=8.


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
