"""Tiny random Mixtral checkpoints built with Hugging Face transformers."""
from __future__ import annotations

import os

import torch
from tests.factories import perturb_norms, save_tokenizer, take_saved_tensors, write_safetensors

MIXTRAL_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=512,
    rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None, tie_word_embeddings=False, eos_token_id=0,
)


def make_mixtral_checkpoint(path: str, layout: str = "hub", shards: int = 1, seed: int = 0, **overrides) -> str:
    """Save a random transformers Mixtral to `path`. layout "hub": the hub's names as save_pretrained
    writes them (block_sparse_moe.experts.{e}.w1 ...); "fused": transformers' in-memory names
    (mlp.gate, mlp.experts.gate_up_proj [E, 2F, D], mlp.experts.down_proj [E, D, F])."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(**{**MIXTRAL_TINY, **overrides})
    model = MixtralForCausalLM(config).float().eval()
    perturb_norms(model, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tensors = take_saved_tensors(path)
    if layout == "fused":
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    write_safetensors(path, tensors, shards)
    save_tokenizer(path, config.vocab_size)
    return path
